"""Stage 3 — rewrite: replace each planned Site by its CommFuse ring.

Flash-AG. Before::

    g = wait_tensor(all_gather_into_tensor(x, N, group))        # [N·a, ...]
    y = mm(view(g, [R, K]), W)                                   # [R, M]

After (rank r; chunk j is rank j's shard)::

    cur = x                                   # chunk r
    for k in 0 .. N-1:
        j = (r - k) % N
        if k < N-1: nxt = ring_exchange(cur, to=r+1, from=r-1)   # start
        y_j = mm(view(cur, [R/N, K]), W)                         # overlaps the transfer
        if k < N-1: cur = wait_tensor(nxt)                       # chunk j-1
    y = cat([y_0, ..., y_{N-1}])              # each chunk at its own offset
    g = cat([x_0, ..., x_{N-1}])              # only if g has other users (e.g. saved for backward)

Flash-RS. Before::

    o = wait_tensor(reduce_scatter_tensor(view(mm(A, B), S), "sum", N, group))

After::

    for i in 0 .. N-1:
        j = (r - 1 - i) % N
        p = mm(A[rows of chunk j], B)
        if i > 0: p = p + wait_tensor(acc)     # partial sum of chunk j from ranks < r
        if i < N-1: acc = ring_exchange(p, to=r+1, from=r-1)   # overlaps the next mm
    o = view(p, shape of o)                    # j = r at the last step: own chunk, no tail

Each step is recorded as a RingStep for the order stage. The replaced nodes are left for
``remove_replaced`` once the graph is sorted again.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from .graph_utils import MM, WAIT, Emitter, aten, erase_if_unused, fake
from .site import RingStep, Site



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
    n, group = site.group_size, site.group_name
    shard = site.collective.args[0]
    first_mm = min((c.mm for c in site.consumers), key=_position(graph))
    emit = Emitter(graph, before=first_mm)
    exchange = _exchange_op()
    chunks: list[fx.Node | None] = [None] * n
    outputs = [[None] * n for _ in site.consumers]
    cur = shard
    for k in range(n):
        j = (r - k) % n
        chunks[j] = cur
        start = emit(exchange, cur, (r + 1) % n, (r - 1) % n, group, next(tags)) if k < n - 1 else None
        compute = []
        for c, consumer in enumerate(site.consumers):
            rows = _chunk_2d(emit, cur, consumer.mm.args[0])
            outputs[c][j] = emit(MM, rows, consumer.mm.args[1])
            compute.append(outputs[c][j])
        wait = emit(WAIT, start) if start is not None else None
        site.steps.append(RingStep(chunk=j, compute=compute, start=start, wait=wait))
        if wait is not None:
            cur = wait
    results = [emit(aten.cat.default, outs, 0) for outs in outputs]
    readers = _whole_tensor_readers(site)
    rebuilt = emit(aten.cat.default, chunks, 0) if readers else None
    for consumer, result in zip(site.consumers, results):
        consumer.mm.replace_all_uses_with(result)
    if rebuilt is not None:
        site.wait.replace_all_uses_with(rebuilt)
        site.notes.append(
            f"gathered tensor rebuilt from the ring's chunks for {', '.join(readers)}"
        )


def _flash_reduce_scatter(graph: fx.Graph, site: Site, r: int, tags: itertools.count) -> None:
    n, group = site.group_size, site.group_name
    (consumer,) = site.consumers
    lhs, rhs = consumer.mm.args[:2]
    rows = fake(consumer.mm).shape[0] // n
    emit = Emitter(graph, before=site.wait)
    exchange = _exchange_op()
    acc = None  # accumulator in flight from rank r-1
    for i in range(n):
        j = (r - 1 - i) % n
        p = emit(MM, emit(aten.slice.Tensor, lhs, 0, j * rows, (j + 1) * rows), rhs)
        compute = [p]
        wait = emit(WAIT, acc) if acc is not None else None
        if wait is not None:
            p = emit(aten.add.Tensor, p, wait)
        site.steps.append(RingStep(chunk=j, compute=compute, start=acc, wait=wait))
        acc = emit(exchange, p, (r + 1) % n, (r - 1) % n, group, next(tags)) if i < n - 1 else None
    result = emit(aten.reshape.default, p, list(fake(site.wait).shape))
    site.wait.replace_all_uses_with(result)


def remove_replaced(graph: fx.Graph, sites: list[Site]) -> None:
    """Drop what the rings replaced: dead views and matmuls, then the collectives themselves
    (``wait_tensor`` is side-effectful, so dead-code elimination alone keeps it)."""
    graph.eliminate_dead_code()
    for site in sites:
        if site.steps:
            erase_if_unused(graph, [site.wait, site.collective])


def _chunk_2d(emit: Emitter, chunk: fx.Node, full_2d: fx.Node) -> fx.Node:
    """The rows of the mm's 2-D left operand that ``chunk`` (one rank's shard) covers."""
    width = fake(full_2d).shape[1]
    if list(fake(chunk).shape) == [fake(chunk).numel() // width, width]:
        return chunk
    return emit(aten.reshape.default, chunk, [-1, width])


def _whole_tensor_readers(site: Site) -> list[str]:
    """Nodes that still read the whole gathered tensor (directly or through a consumer's
    reshape) once the consumer matmuls are rewritten, e.g. a save for backward."""
    mms = {c.mm for c in site.consumers}
    views = {c.view for c in site.consumers if c.view is not None}
    names = [u.name for u in site.wait.users if u not in mms and u not in views]
    for view in views:
        names += [f"{u.name} (via {view.name})" for u in view.users if u not in mms]
    return names


def _position(graph: fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__
