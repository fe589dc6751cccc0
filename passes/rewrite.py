"""Stage 3 — rewrite: replace each planned Site by its CommFuse ring.

Flash-AG. Before (G is the gathered tensor, chunk q = rank q's shard along dim d)::

    G = all_gather(x) [-> split/cat to dim d]                   # N chunks along d
    y = mm(view(G, [R, K]), W)                                   # one or more consumers

After (rank r)::

    cur = x                                   # chunk r
    for k in 0 .. N-1:
        j = (r - k) % N
        if k < N-1: nxt = ring_exchange(cur, to=r+1, from=r-1)   # start
        y_j = mm(view(cur, [-1, K]), W)                          # overlaps the transfer
        if k < N-1: cur = wait_tensor(nxt)                       # chunk j-1
    y = view(cat([y_0, ..., y_{N-1}], d), [R, M])   # each chunk at its own offset
    G = cat([x_0, ..., x_{N-1}], d)                 # only if G has other readers (saved for bw)

A consumer may also read the gathered rows as the *columns* of its output (``X @ G.t()``,
a weight gather: y_j = X @ chunk.t(), concatenated along dim 1) or as its *contraction* dim
(``G.t() @ dY`` or ``A @ G``: y += chunk.t() @ dY[rows of j], summed over the steps).

Flash-RS. Before (P is a sum of matmul terms, scattered in chunks along dim d)::

    P = view(mm(A_1, B_1) + ... + mm(A_t, B_t))
    o = wait_tensor(reduce_scatter([split/cat of] P, "sum", N, group))

After::

    for i in 0 .. N-1:
        j = (r - 1 - i) % N
        p = mm(A_1[rows of chunk j], B_1) + ... + mm(A_t[rows of chunk j], B_t)
        if i > 0: p = p + wait_tensor(acc)     # partial sum of chunk j from ranks < r
        if i < N-1: acc = ring_exchange(p, to=r+1, from=r-1)   # overlaps the next step
    o = view(p, shape of o)                    # j = r at the last step: own chunk, no tail

``mm`` stands for ``addmm(bias, ·, ·)`` too. Each step is recorded as a RingStep for the order
stage; the replaced nodes are left for ``remove_replaced`` once the graph is sorted again.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from .graph_utils import ADDMM, MM, WAIT, Emitter, aten, erase_if_unused, fake, left_operand, right_operand
from .site import Consumer, RingStep, Site


def _exchange_op():
    import commfuse_compile.p2p  # noqa: F401  (registers torch.ops.commfuse.ring_exchange)

    return torch.ops.commfuse.ring_exchange.default


def rewrite_site(graph: fx.Graph, site: Site, rank: int, tags: itertools.count) -> None:
    """Emit the ring for ``site`` (decision "rewrite") in place."""
    site.rank = rank
    if site.pattern == "all_gather→mm":
        _flash_all_gather(graph, site, rank, tags)
    else:
        _flash_reduce_scatter(graph, site, rank, tags)


def _flash_all_gather(graph: fx.Graph, site: Site, r: int, tags: itertools.count) -> None:
    n, d, group = site.group_size, site.dim, site.group_name
    shard = site.collective.args[0]
    first_mm = min((c.mm for c in site.consumers), key=_position(graph))
    emit = Emitter(graph, before=first_mm)
    exchange = _exchange_op()
    chunks: list[fx.Node | None] = [None] * n
    pieces = [[None] * n for _ in site.consumers]
    cur = shard  # chunk r
    for k in range(n):
        j = (r - k) % n
        chunks[j] = cur
        start = emit(exchange, cur, (r + 1) % n, (r - 1) % n, group, next(tags)) if k < n - 1 else None
        compute = []
        for c, consumer in enumerate(site.consumers):
            y_j = _chunk_product(emit, consumer, site, cur, j)
            compute.append(y_j)
            pieces[c][j] = _in_chunk_layout(emit, consumer, y_j, cur, d)
        wait = emit(WAIT, start) if start is not None else None
        site.steps.append(RingStep(chunk=j, compute=compute, start=start, wait=wait))
        if wait is not None:
            cur = wait
    results = [_assemble(emit, consumer, outs, d, order=[s.chunk for s in site.steps])
               for consumer, outs in zip(site.consumers, pieces)]
    readers = _whole_tensor_readers(site)
    rebuilt = emit(aten.cat.default, chunks, d) if readers else None
    for consumer, result in zip(site.consumers, results):
        consumer.mm.replace_all_uses_with(result)
    if rebuilt is not None:
        site.tensor.replace_all_uses_with(rebuilt)
        site.notes.append(f"gathered tensor rebuilt from the ring's chunks for {', '.join(readers)}")


def _chunk_product(emit: Emitter, consumer: Consumer, site: Site, chunk: fx.Node, j: int) -> fx.Node:
    """The consumer matmul applied to chunk ``j`` (held in ``chunk``)."""
    width = fake(consumer.view or site.tensor).shape[-1]
    rows = _as_rows(emit, chunk, width)  # the chunk as rows of the matmul's 2-D operand
    if consumer.role == "rows":  # y[rows of j] = chunk @ W
        return _matmul_like(emit, consumer, rows)
    other = consumer.other_operand(site.tensor)
    transposed = emit(aten.permute.default, rows, [1, 0])
    if consumer.role == "columns":  # y[:, columns of j] = X @ chunk^T
        return emit(MM, other, transposed)
    if consumer.permute is not None:  # y += chunk^T @ dY[rows of j]
        return emit(MM, transposed, _rows_of_chunk(emit, other, site, j))
    # y += A[:, columns of j] @ chunk
    columns = _rows_of_chunk(emit, emit(aten.permute.default, other, [1, 0]), site, j)
    return emit(MM, emit(aten.permute.default, columns, [1, 0]), rows)


def _rows_of_chunk(emit: Emitter, matrix: fx.Node, site: Site, j: int) -> fx.Node:
    """The rows of a 2-D ``matrix`` whose rows are the flattened leading dims of the gathered
    (or scattered) tensor, that belong to chunk ``j``: a row block on dim 0, a slice of the un-flattened
    view on dim d > 0 (those rows are not contiguous), flattened again."""
    n, d = site.group_size, site.dim
    leading = list(fake(site.tensor).shape[:-1])
    width = fake(matrix).shape[1]
    if d == 0:
        size = fake(matrix).shape[0] // n
        return emit(aten.slice.Tensor, matrix, 0, j * size, (j + 1) * size)
    size = leading[d] // n
    unflat = emit(aten.reshape.default, matrix, [*leading, width])
    return emit(aten.reshape.default, emit(aten.slice.Tensor, unflat, d, j * size, (j + 1) * size), [-1, width])


def _in_chunk_layout(emit: Emitter, consumer: Consumer, y_j: fx.Node, chunk: fx.Node, d: int) -> fx.Node:
    """Along dim 0 a chunk's output rows (or columns) are a block of the output; along d > 0
    they are not, so the piece goes back to the chunk's own layout before the concatenation."""
    if d == 0 or consumer.role == "contraction":
        return y_j
    leading = list(fake(chunk).shape[:-1])
    if consumer.role == "rows":
        return emit(aten.reshape.default, y_j, [*leading, -1])
    return emit(aten.reshape.default, y_j, [fake(y_j).shape[0], *leading])  # columns


def _assemble(emit: Emitter, consumer: Consumer, pieces: list[fx.Node], d: int, order: list[int]) -> fx.Node:
    """The consumer's full result from its per-chunk pieces (indexed by chunk)."""
    if consumer.role == "contraction":  # partial products, summed in ring order
        # One matmul would accumulate the whole contraction in fp32 and round once; summing
        # rounded low-precision partials would lose that, so sum them in fp32.
        dtype = fake(consumer.mm).dtype
        wide = dtype in (torch.bfloat16, torch.float16)
        to = torch.ops.prims.convert_element_type.default
        parts = [emit(to, pieces[j], torch.float32) if wide else pieces[j] for j in order]
        total = parts[0]
        for part in parts[1:]:
            total = emit(aten.add.Tensor, total, part)
        return emit(to, total, dtype) if wide else total
    columns = consumer.role == "columns"
    y = emit(aten.cat.default, pieces, 1 + d if columns else d)
    return y if d == 0 else emit(aten.reshape.default, y, list(fake(consumer.mm).shape))


def _flash_reduce_scatter(graph: fx.Graph, site: Site, r: int, tags: itertools.count) -> None:
    n, group = site.group_size, site.group_name
    emit = Emitter(graph, before=site.wait)
    exchange = _exchange_op()
    acc = None  # partial sum of this step's chunk, in flight from rank r-1
    for i in range(n):
        j = (r - 1 - i) % n
        compute = [
            _matmul_like(emit, term, _rows_of_chunk(emit, left_operand(term.mm), site, j)) for term in site.consumers
        ]
        p = compute[0]
        for part in compute[1:]:
            p = emit(aten.add.Tensor, p, part)
        wait = emit(WAIT, acc) if acc is not None else None
        if wait is not None:
            p = emit(aten.add.Tensor, p, wait)
        site.steps.append(RingStep(chunk=j, compute=compute, start=acc, wait=wait))
        acc = emit(exchange, p, (r + 1) % n, (r - 1) % n, group, next(tags)) if i < n - 1 else None
    result = emit(aten.reshape.default, p, list(fake(site.wait).shape))
    site.wait.replace_all_uses_with(result)


def _matmul_like(emit: Emitter, consumer: Consumer, rows: fx.Node) -> fx.Node:
    """The consumer's matmul (mm, addmm with a 1-D bias, or an addmm's product alone)
    applied to other rows of its left operand."""
    matmul = consumer.mm
    if matmul.target is ADDMM and consumer.role != "product":
        return emit(ADDMM, matmul.args[0], rows, right_operand(matmul))
    return emit(MM, rows, right_operand(matmul))


def _as_rows(emit: Emitter, chunk: fx.Node, width: int) -> fx.Node:
    """``chunk`` (one rank's shard) as rows of the matmul's 2-D left operand."""
    shape = list(fake(chunk).shape)
    if shape == [fake(chunk).numel() // width, width]:
        return chunk
    return emit(aten.reshape.default, chunk, [-1, width])


def _whole_tensor_readers(site: Site) -> list[str]:
    """Nodes that still read the whole gathered tensor (directly or through a consumer's
    reshape or transpose) once the consumer matmuls are rewritten, e.g. a save for backward."""
    chain = {c.view for c in site.consumers} | {c.permute for c in site.consumers}
    covered = chain | {c.mm for c in site.consumers}
    names = []
    for node in [site.tensor, *(n for n in chain if n is not None)]:
        via = "" if node is site.tensor else f" (via {node.name})"
        names += [f"{u.name}{via}" for u in node.users if u not in covered]
    return names


def remove_replaced(graph: fx.Graph, sites: list[Site]) -> None:
    """Drop what the rings replaced: dead views, splits and matmuls, then the collectives
    (``wait_tensor`` is side-effectful, so dead-code elimination alone keeps it)."""
    graph.eliminate_dead_code()
    for site in sites:
        if site.steps:
            erase_if_unused(graph, [site.wait, site.collective])


def _position(graph: fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__
