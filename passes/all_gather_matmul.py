"""Pattern ``all_gather_matmul``: an all-gather feeding matmuls, rewritten as Flash-AG.

Matches (post-grad aten graph, functional collectives; ``[ ]`` is optional)::

    all_gather_into_tensor(x, N, group) -> wait_tensor
        [-> split(dim 0) -> getitem × N -> cat(dim d)]    gather on dim d != 0 (or N slices)
        [-> permute / clone ...]                           movedim(0, d)[.contiguous()]
        -> [reshape / clone / view(dtype) ...] -> [permute(·, [1, 0]) ...]
        -> mm / addmm / _scaled_mm                           one or more consumers

Each consumer reads the gathered tensor G as its left operand's rows (``G @ W``: chunks of output
rows), through a transpose as its right operand's columns (``X @ G.t()``, FSDP's weight gather:
chunks of output columns), or along the contracted dim (``G.t() @ dY``, ``A @ G``, and
``AG(A, dim=-1) @ B``: each chunk a partial product, summed). fp8 is gathered as its bytes
(``view(uint8)``, viewed back as fp8): a ``_scaled_mm`` consumer reads rows, each piece with the
rows of a rowwise ``scale_a`` (a tensorwise one whole). A consumer whose other operand depends
on G is left as is. Other
readers of G (a save for backward) get it rebuilt from the pieces, never by a second gather.

The cost model times (:func:`AllGatherMatmul.workload`): the consumers' matmuls with the dims
of G (the one dim only this rank's other operand has is taken as G's width) and one rank's
shard in bytes: vanilla (gather, then the matmuls), slicing, and the rings.

Emits (rank r, ring schedule; :func:`commfuse_compile.schedules.flash_ag_steps` says which piece
each step computes, sends and receives)::

    cur = x                                                       # chunk r
    for k in 0 .. N-1:
        if k < N-1: nxt = ring_exchange(cur, to=r+1, from=r-1)     # start
        y_j = mm(view(cur), W)  for j = (r - k) % N                 # overlaps the transfer
        if k < N-1: cur = wait_tensor(nxt)                         # chunk j - 1
    y = view(cat([y_0, ..., y_{N-1}], d))       # each chunk at its own offset
    G = cat([x_0, ..., x_{N-1}], d)             # only if G has other readers

With m pieces per chunk each step is m sub-steps of m times smaller transfers; the
bidirectional ring sends half of the pieces the other way (both links busy). The slicing
baseline instead issues K sliced all-gathers, slice s + 1's overlapping slice s's matmuls (the
first one exposed)::

    g_0 = all_gather(x_0)
    for s in 0 .. K-1:
        if s < K-1: g_{s+1} = all_gather(x_{s+1})
        y_s = mm(view(wait(g_s)), W)                 # rows of pieces (0, s), ..., (N-1, s)
"""

from __future__ import annotations

import itertools
from math import prod

import torch
import torch.fx as fx

from commfuse_compile.cost_model import Matmul, Workload
from commfuse_compile.schedules import flash_ag_steps, pieces_per_chunk, slice_pieces

from .chunks import accumulate, assemble, chunk_problem, cut, in_layout, join, matmul_problem, output_axis, piece_product
from .fusion import Fuse
from .graph_utils import ADDMM, ALL_GATHER, DTYPE_VIEW, MATMULS, SCALED_MM, SPLITS, WAIT, Emitter, aten, bytes_of, c10d, depends_on, describe_users, divides, fake, hinted_shape, left_operand, right_operand, ring_exchange_op, same_shape, shape_of
from .layout import after_permutes, reshape_chains, single_wait, split_cat, transpose_chains
from .pattern import Pattern
from .pieces import Pieces
from .prologue import needed, prologue_consumers, prologue_problem, prologue_region
from .site import Consumer, RingStep, Site, coalesced_site


class AllGatherMatmul(Pattern):
    name = "all_gather_matmul"
    flash = "Flash-AG"
    option = "flash_ag"
    collectives = frozenset({ALL_GATHER, c10d.all_gather_into_tensor_coalesced.default})

    # ---- match ---------------------------------------------------------------------------

    def match(self, ag: fx.Node, graph_kind: str) -> Site:
        if ag.target is not ALL_GATHER:
            return coalesced_site(self.name, ag, graph_kind)
        shard, group_size, group_name = ag.args[:3]
        site = Site(self.name, graph_kind, ag, single_wait(ag), group_name, group_size)
        site.shapes["shard"] = shape_of(shard)
        if site.wait is None:
            return site.skip(f"all-gather is not read through a single wait_tensor (users: {describe_users(ag)})")
        site.tensor, site.dim = split_cat(site.wait, group_size, 0) or (site.wait, 0)
        if fake(site.tensor).dtype != fake(site.wait).dtype:  # (chunks viewed as another dtype before the cat)
            site.chunk_dtype = fake(site.tensor).dtype
        site.tensor, site.dim, permutation, site.layout = after_permutes(site.tensor, site.dim)
        if permutation != tuple(range(len(permutation))):
            site.permutation = permutation
        if site.dim:
            site.shapes["gathered"] = shape_of(site.tensor)
        last = site.dim == fake(site.tensor).dim() - 1 and site.dim > 0  # a gather along the last dim
        consumers = list(_matmul_consumers(site.tensor, int(last)))
        if not consumers and not last:
            consumers = _through_prologue(site)
        if not consumers:
            if any(u.target is ADDMM and u.args[0] is site.tensor for u in site.tensor.users):
                return site.skip("the gathered tensor is only added as an addmm bias: no matmul to overlap with")
            if site.tensor is site.wait and len(site.wait.users) == 1 and next(iter(site.wait.users)).target in SPLITS:
                return site.skip(
                    f"the gathered tensor is split into its chunks, but they are not concatenated back in order by one cat "
                    f"(the split's readers: {describe_users(next(iter(site.wait.users)))}): the gathered dim is not known"
                )
            return site.skip(f"no matmul reads the gathered tensor (users: {describe_users(site.tensor)})")
        for consumer in consumers:
            if depends_on(consumer.other_operand(site.tensor), site.wait):
                site.notes.append(f"{consumer.mm.name}: its other operand depends on the gathered tensor; left as is")
            else:
                site.consumers.append(consumer)
        if not site.consumers:
            return site.skip("the other operand of every consuming matmul depends on the gathered tensor")
        for i, consumer in enumerate(site.consumers):
            site.shapes[f"{consumer.role}{i}"] = shape_of(consumer.other_operand(site.tensor))
        return site

    # ---- plan ----------------------------------------------------------------------------

    def keep_computable(self, site: Site, tensor: list[int]) -> str | None:
        kept = []
        for consumer in site.consumers:
            why_not = matmul_problem(consumer.mm) or self.cut_problem(site, tensor, consumer, site.group_size)
            if why_not:
                site.notes.append(f"{consumer.mm.name}: {why_not}; left as is")
            else:
                kept.append(consumer)
        site.consumers = kept
        return None if kept else "no consuming matmul can be computed chunk by chunk: " + "; ".join(site.notes)

    def cut_problem(self, site: Site, tensor: list[int], consumer: Consumer, count: int) -> str | None:
        view = list(fake(consumer.operand_shape_of(site.tensor)).shape)
        if consumer.source is not None and (problem := prologue_problem(site, count, set())):
            return problem
        if consumer.mm.target is SCALED_MM and (consumer.role != "rows" or consumer.gathered_axis):
            return "a _scaled_mm reading the gathered dim as anything but its left operand's rows: not yet supported"
        if consumer.gathered_axis == 0:
            return chunk_problem(tensor, site.dim, count, view)
        # The last dim is gathered: pieces are column blocks of the 2-D view, contracted with
        # row blocks of the right operand (``AG(A, dim=-1) @ B``).
        if consumer.transposed or left_operand(consumer.mm) is not consumer.reads(site.tensor):
            how = "through a transpose" if consumer.transposed else "as its right operand"
            return f"the gathered dim is the last of {tensor}, read {how}: not yet supported"
        if tensor[-1] % count:
            return f"dim {site.dim} of {tensor} does not split into {count} pieces"
        if not same_shape(view, [prod(tensor[:-1]), tensor[-1]]):
            return f"{view} is not {tensor} with its leading dims flattened"
        return None

    def workload(self, site: Site) -> Workload:
        """The consumers' matmuls in dims every rank shares (G as the matmul reads it, [rows,
        width]; the other operand's own dim as ``width``: with uneven shards it differs
        between ranks, and a plan that read it could differ too) and the shard's bytes."""
        matmuls = []
        for consumer in site.consumers:
            rows, width = hinted_shape(consumer.operand_shape_of(site.tensor))
            if consumer.gathered_axis == 1:  # G[rows, width] @ W[width, n], contracted in pieces
                matmuls.append(Matmul(rows, width, width, "k"))
            elif consumer.role == "rows":  # G[rows, width] @ W[width, n]
                matmuls.append(Matmul(rows, width, width, "m"))
            elif consumer.role == "columns":  # X[m, width] @ G^T[width, rows]
                matmuls.append(Matmul(width, width, rows, "n"))
            else:  # contraction: G^T[width, rows] @ dY[rows, n], or A[m, rows] @ G
                matmuls.append(Matmul(width, rows, width, "k"))
        shard = fake(site.collective.args[0])
        return Workload(self.name, site.group_size, tuple(matmuls), bytes_of(shard), fake(site.consumers[0].mm).dtype)

    # ---- emit ----------------------------------------------------------------------------

    def emit(self, graph: fx.Graph, site: Site, rank: int, tags: itertools.count, fuse: Fuse) -> None:
        if site.schedule == "slicing":
            _sliced(graph, site, fuse)
        else:
            _ring(graph, site, rank, tags, fuse)


def _through_prologue(site: Site) -> list[Consumer]:
    """Matmuls that read the gathered tensor's rows through row-local ops (a residual add, a
    norm): they become the consumers, and those ops the site's prologue."""
    region = prologue_region(site, site.group_size, set())
    if region is None:
        return []
    consumers = prologue_consumers(site, region, lambda node: _matmul_consumers(node, 0))
    if consumers:
        site.prologue = needed(region, consumers).computed
        site.notes.append(f"computed on each piece before the matmuls: {', '.join(n.name for n in site.prologue)}")
    return consumers


def _matmul_consumers(gathered: fx.Node, gathered_axis: int):
    """Matmuls reading the gathered tensor through a chain of reshapes and a chain of
    ``permute(·, [1, 0])``, with the role the gathered dim plays in each: the gathered axis of
    the 2-D view (``gathered_axis``), swapped by a transpose, is the output's rows or the
    contraction for the left operand, the contraction or the output's columns for the right."""
    for view, views in reshape_chains(gathered):
        for operand, permutes in transpose_chains(view):
            axis = gathered_axis ^ (len(permutes) % 2)
            for mm in operand.users:
                if mm.target not in MATMULS:
                    continue
                left, right = left_operand(mm) is operand, right_operand(mm) is operand
                if left == right:  # not an operand, or both (x @ x.t()): leave it
                    continue
                role = ("rows", "contraction")[axis] if left else ("contraction", "columns")[axis]
                yield Consumer(mm=mm, views=views, role=role, permutes=permutes, gathered_axis=gathered_axis)


class _Pieces:
    """What a Flash-AG rewrite accumulates: the pieces it held, each consumer's output pieces
    (in tensor order) and partial products (contraction consumers, in ring order)."""

    def __init__(self, site: Site, count: int, fuse: Fuse):
        self.site, self.count = site, count
        self.prologue = _prologue_pieces(site, count, fuse)
        self.held: list[fx.Node | None] = [None] * count
        self.outputs: list[list[fx.Node | None]] = [[None] * count for _ in site.consumers]
        self.partials: list[list[fx.Node]] = [[] for _ in site.consumers]

    def as_gathered(self, emit: Emitter, received: fx.Node) -> fx.Node:
        """A piece as it arrived (in the collective's dtype), as the gathered tensor's pieces are."""
        return received if self.site.chunk_dtype is None else emit(DTYPE_VIEW, received, self.site.chunk_dtype)

    def compute(self, emit: Emitter, held: fx.Node, pieces: list[int], fused) -> list[fx.Node]:
        """Every consumer on ``held`` (the tensor's ``pieces``, in its layout), then what
        ``fused`` computes on them; returns the nodes that overlap the step's transfer."""
        d, nodes = self.site.dim, []
        if self.prologue is not None:  # the row-local ops before the matmuls, on these pieces
            for q in pieces:
                self.prologue.give(self.site.tensor, q, self.held[q])
                nodes += self.prologue.compute(emit, q)
        for c, consumer in enumerate(self.site.consumers):
            rows = held if consumer.source is None else join(emit, [self.prologue.value(emit, consumer.source, q) for q in pieces], d)
            y = piece_product(emit, consumer, self.site, rows, pieces, self.count)
            if consumer.role == "contraction":
                y = self._add_partial(emit, c, y)
            nodes.append(y)
            if consumer.role != "contraction":  # (slicing holds one piece per rank, side by side along d)
                laid_out = in_layout(emit, consumer, y, held, d)
                for q, part in zip(pieces, cut(emit, laid_out, output_axis(consumer, d), len(pieces))):
                    self.outputs[c][q] = part
        for q in pieces:
            nodes += fused.step(emit, q, [out[q] for out in self.outputs])
        return nodes

    def _add_partial(self, emit: Emitter, c: int, y: fx.Node) -> fx.Node:
        """Keep consumer c's partial product ``y``: in fp32 accumulated onto the partials before
        it by the matmul itself (:func:`accumulate`); in low precision kept apart, to be summed
        in fp32 (:func:`assemble`)."""
        partials = self.partials[c]
        if not partials or fake(y).dtype != torch.float32:
            partials.append(y)
            return y
        partials[-1] = accumulate(emit, partials[-1], y)
        return partials[-1]

    def finish(self, emit: Emitter) -> None:
        """Replace each consumer by its result put back together; serve any other reader of the
        gathered tensor from the pieces held (never by a second collective)."""
        site = self.site
        readers = _whole_tensor_readers(site)
        for c, consumer in enumerate(site.consumers):
            parts = self.partials[c] if consumer.role == "contraction" else self.outputs[c]
            consumer.mm.replace_all_uses_with(assemble(emit, consumer, parts, site.dim))
        if self.prologue is not None:  # what is read besides the matmuls (h, a saved norm)
            self.prologue.assemble(emit)
        if readers:
            whole = emit(aten.cat.default, self.held, site.dim)
            if not same_shape(fake(whole).shape, fake(site.tensor).shape):  # pieces cut as rows (_shard_pieces)
                whole = emit(aten.reshape.default, whole, list(fake(site.tensor).shape))
            site.tensor.replace_all_uses_with(whole)
            site.notes.append(f"gathered tensor rebuilt from the pieces for {', '.join(readers)}")


def _ring(graph: fx.Graph, site: Site, r: int, tags: itertools.count, fuse: Fuse) -> None:
    """Flash-AG, one-way or bidirectional, as :func:`flash_ag_steps` lays it out."""
    per_chunk = pieces_per_chunk(site.schedule, site.chunks_per_rank)
    count = site.group_size * per_chunk
    emit = _emitter_before_consumers(graph, site)
    fused = fuse.after_gather(site, count)
    exchange = ring_exchange_op()
    pieces = _Pieces(site, count, fuse)
    cur = dict(enumerate(_shard_pieces(emit, site, per_chunk)))  # stream -> the piece it holds
    for step in flash_ag_steps(site.group_size, r, site.schedule, site.chunks_per_rank):
        for sub in step:
            starts = {mv.stream: emit(exchange, cur[mv.stream], mv.send_to, mv.recv_from, site.group_name, next(tags)) for mv in sub if mv.sends}
            computed = {}
            for mv in sub:
                pieces.held[mv.piece] = pieces.as_gathered(emit, cur[mv.stream])
                computed[mv.stream] = pieces.compute(emit, pieces.held[mv.piece], [mv.piece], fused)
            for mv in sub:
                wait = emit(WAIT, starts[mv.stream]) if mv.receives else None
                site.steps.append(RingStep(chunk=mv.piece, compute=computed[mv.stream], start=starts.get(mv.stream), wait=wait))
                if wait is not None:
                    cur[mv.stream] = wait
    fused.finish(emit)
    pieces.finish(emit)


def _sliced(graph: fx.Graph, site: Site, fuse: Fuse) -> None:
    """The slicing baseline: K sliced all-gathers, each overlapping the previous slice's matmuls."""
    n, d, k, group = site.group_size, site.dim, site.chunks_per_rank, site.group_name
    count = n * k
    emit = _emitter_before_consumers(graph, site)
    fused = fuse.after_gather(site, count)
    pieces = _Pieces(site, count, fuse)
    slices = _shard_pieces(emit, site, k)
    gathers = [emit(ALL_GATHER, slices[0], n, group)]
    waits = [emit(WAIT, gathers[0])]  # slice 0: exposed
    for s in range(k):
        if s < k - 1:
            gathers.append(emit(ALL_GATHER, slices[s + 1], n, group))
        gathered = pieces.as_gathered(emit, _in_dim_layout(emit, waits[s], n, d))  # pieces (0, s) .. (N-1, s) along d
        carried = slice_pieces(n, k, s)
        for q, piece in zip(carried, cut(emit, gathered, d, n)):
            pieces.held[q] = piece
        compute = pieces.compute(emit, gathered, carried, fused)
        wait = emit(WAIT, gathers[s + 1]) if s < k - 1 else None
        site.steps.append(RingStep(chunk=s, compute=compute, start=gathers[s + 1] if s < k - 1 else None, wait=wait))
        if wait is not None:
            waits.append(wait)
    fused.finish(emit)
    pieces.finish(emit)


def _prologue_pieces(site: Site, count: int, fuse: Fuse) -> Pieces | None:
    """The emitter of the site's prologue on ``count`` pieces (None: the matmuls read the
    gathered tensor itself)."""
    if not site.prologue:
        return None
    region = prologue_region(site, count, fuse.reserved - set(site.prologue))
    if region is None or any(c.source is not None and region.axis.get(c.source) != site.dim for c in site.consumers):
        raise RuntimeError(f"commfuse: the prologue of {site.collective.name} changed between plan and rewrite")
    return Pieces(needed(region, site.consumers))


def _emitter_before_consumers(graph: fx.Graph, site: Site) -> Emitter:
    """An emitter placing nodes before the first consumer matmul."""
    return Emitter(graph, before=min(c.mm for c in site.consumers))  # (nodes compare by position)


def _shard_pieces(emit: Emitter, site: Site, parts: int) -> list[fx.Node]:
    """This rank's shard cut into ``parts`` pieces along the site's dim. Along dim 0 a piece is
    a block of whole rows; where dim 0 has too few entries (a batch-1 sequence gather,
    [1, S/N, H]) the shard is cut as rows of [-1, H] instead."""
    shard = site.collective.args[0]
    if site.permutation:  # the logical chunk: the shard as the gathered tensor is permuted after
        shard = emit(aten.permute.default, shard, list(site.permutation))
    if site.dim == 0 and not divides(parts, fake(shard).shape[0]):
        shard = emit(aten.reshape.default, shard, [-1, fake(site.tensor).shape[-1]])
    return cut(emit, shard, site.dim, parts)


def _in_dim_layout(emit: Emitter, gathered: fx.Node, n: int, d: int) -> fx.Node:
    """all_gather stacks the ranks' pieces on dim 0; put them side by side along d."""
    if d == 0:
        return gathered
    if isinstance(fake(gathered).shape[0], int):
        return emit(aten.cat.default, cut(emit, gathered, 0, n), d)
    # A symbolic dim 0 (a dynamic batch): the blocks are the entries of [n, ...] (static indices).
    shape = fake(gathered).shape
    stacked = emit(aten.reshape.default, gathered, [n, shape[0] // n, *shape[1:]])
    return emit(aten.cat.default, [emit(aten.select.int, stacked, 0, j) for j in range(n)], d)


def _whole_tensor_readers(site: Site) -> list[str]:
    """Nodes that still read the whole gathered tensor (directly or through a consumer's
    reshape or transpose) once the consumer matmuls are rewritten, e.g. a save for backward."""
    chain = {v for c in site.consumers for v in (*c.views, *c.permutes)}
    covered = chain | {c.mm for c in site.consumers} | set(site.prologue)
    names = []
    for node in [site.tensor, *chain]:
        via = "" if node is site.tensor else f" (via {node.name})"
        names += [f"{u.name}{via}" for u in node.users if u not in covered]
    return names
