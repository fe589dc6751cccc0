"""Fusion: the row-local ops next to a ring, computed inside its steps.

A ring step computes one piece q of rows (piece q of the gathered / scattered dim). An op whose
output rows depend only on the same rows of its inputs can be computed on that piece too, so
more compute overlaps each transfer.

After Flash-AG (:func:`forward_region`). Before (SwiGLU after a sequence gather)::

    y1 = mm(view(G), W1); y3 = mm(view(G), W3)
    h = silu(view(y1)) * view(y3)          # row-local
    z = mm(view(h), W2)                    # a reduce-scatter's matmul: another site, stops here

After: step k computes y1_q, y3_q, then h_q = silu(view(y1_q)) * view(y3_q) for the piece it
holds; what is read after the region (``h`` by ``z``, ``y1`` saved for backward) is put back
together once, in tensor order: h = cat(h_0, ..., h_{count-1}).

Before Flash-RS (:func:`backward_region`). Before::

    a = sdpa(q, k, v, causal)[0];  o = reduce_scatter(mm(view(permute(a)), Wo))

After: step i computes the rows of piece q of the matmul's left operand from the pieces of its
own inputs instead of slicing them out of the full tensor. Attention is row-local in the query
dim: on query rows [s, e) it is ``sdpa(q[s:e], k[:e], v[:e])`` with the causal mask offset by
s (the paper's query-split attention); its outputs saved for backward are assembled once.

Row-local ops (:func:`input_axes`): pointwise ops (torch's ``pointwise`` tag) with
broadcasting, reshapes that keep a piece a block, permutes, unsqueeze, expand, reductions over
other dims, ``mm``
/ ``addmm`` whose right operand does not depend on the pieces (a replicated weight), and CPU
flash attention cut along batch, heads or queries. Each region node is cut along one axis; an
operand outside the region is sliced along its matching axis, or read whole where it
broadcasts. Regions that contain no compute (only views) are dropped: nothing to gain.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from math import prod

import torch
import torch.fx as fx

from commfuse_compile._compat import stable_topological_sort

from .chunks import join, rows_of_pieces
from .graph_utils import ADDMM, MM, RESHAPES, Emitter, aten, fake, left_operand, right_operand
from .site import Site

SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}
VIEWS = {*RESHAPES, aten.permute.default, aten.unsqueeze.default, aten.expand.default, operator.getitem}


def input_axes(node: fx.Node, axis: int, count: int) -> dict[fx.Node, int | None] | None:
    """For ``node`` cut into ``count`` pieces along ``axis``: the axis each tensor input is cut
    along (None: read whole), or None if piece q of the output is not computable from piece q
    of its inputs."""
    out = fake(node)
    if isinstance(out, torch.Tensor) and (axis >= out.dim() or out.shape[axis] % count):
        return None
    inputs = node.all_input_nodes
    if not all(isinstance(fake(i), (torch.Tensor, tuple)) for i in inputs):
        return None  # symbolic sizes among the inputs
    target = node.target
    if target in RESHAPES:
        return _single(inputs[0], reshape_axis(list(out.shape), axis, list(fake(inputs[0]).shape), count))
    if target is aten.permute.default:
        return _single(inputs[0], list(node.args[1])[axis] % out.dim())
    if target is aten.unsqueeze.default:
        inserted = node.args[1] % out.dim()
        return None if axis == inserted else _single(inputs[0], axis - (axis > inserted))
    if target is aten.expand.default:  # (its size 1 dims broadcast: read whole along them)
        return _broadcast_axes(out.shape, inputs, axis)
    if target in REDUCTIONS:
        return _single(inputs[0], _reduced_input_axis(node, axis))
    if target in (MM, ADDMM):
        return _matmul_axes(node, axis)
    if target is SDPA:
        return _attention_axes(node, axis)
    if target is operator.getitem and inputs and inputs[0].target is SDPA:
        return {inputs[0]: axis}
    if isinstance(target, torch._ops.OpOverload) and _pointwise(target) and isinstance(out, torch.Tensor):
        return _broadcast_axes(out.shape, inputs, axis)
    return None


def _single(node: fx.Node, axis: int | None) -> dict[fx.Node, int | None] | None:
    return None if axis is None else {node: axis}


def _pointwise(target: torch._ops.OpOverload) -> bool:
    """Pointwise, and safe to run per piece: not random, not in-place."""
    tags = target.tags
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags and not target._schema.is_mutable


def reshape_axis(shape: list[int], axis: int, other: list[int], count: int) -> int | None:
    """The axis of ``other`` (a reshape of ``shape``, or the reverse) along which the ``count``
    blocks of ``shape``'s ``axis`` are again ``count`` blocks, if any. Row-major: the elements
    with one index of the leading dims form one run; block q of ``axis`` is a sub-run of length
    size/count·(trailing numel), a block of ``other``'s axis j exactly when j has the same leading
    numel and that length is a multiple of j's trailing numel."""
    leading, run = prod(shape[:axis]), shape[axis] // count * prod(shape[axis + 1 :])
    for j, size in enumerate(other):
        if prod(other[:j]) == leading and size > 1:
            trailing = prod(other[j + 1 :])
            return j if run % trailing == 0 and size % count == 0 else None
        if prod(other[:j]) > leading:
            break
    return None


def _reduced_input_axis(node: fx.Node, axis: int) -> int | None:
    x, dims = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    ndim = fake(x).dim()
    if not dims:
        return None  # a full reduction mixes every row
    dims = {d % ndim for d in dims}
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    kept = list(range(ndim)) if keepdim else [d for d in range(ndim) if d not in dims]
    return None if kept[axis] in dims else kept[axis]


def _matmul_axes(node: fx.Node, axis: int) -> dict[fx.Node, int | None] | None:
    """Rows of ``mm(A, B)`` are rows of A: B is read whole (an addmm's bias is cut like the
    output, or read whole where it broadcasts)."""
    if axis != 0:
        return None
    bias, a, b = node.args if node.target is ADDMM else (None, *node.args)
    if a is b or bias in (a, b):
        return None
    axes = {a: 0, b: None}
    if isinstance(bias, fx.Node):
        bias_shape = fake(bias).shape
        axes[bias] = 0 if len(bias_shape) == 2 and bias_shape[0] == fake(node).shape[0] > 1 else None
    return axes


def _attention_axes(node: fx.Node, axis: int) -> dict[fx.Node, int | None] | None:
    """CPU flash attention ``(q, k, v, dropout, is_causal, attn_mask=, scale=)``, outputs
    (out [B, H, L, E], logsumexp [B, H, L]): row-local in batch and heads (k, v cut alike) and,
    without dropout or a mask, in the queries (k, v read whole; see :func:`_query_split`)."""
    q, k, v = node.args[:3]
    dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    if dropout or node.kwargs.get("attn_mask") is not None or len({q, k, v}) < 3:
        return None
    if axis in (0, 1):
        return {q: axis, k: axis, v: axis}
    if axis == 2 and fake(q).shape[2] == fake(k).shape[2]:
        return {q: 2, k: None, v: None}
    return None


def _broadcast_axes(shape: torch.Size, inputs: list[fx.Node], axis: int) -> dict[fx.Node, int | None] | None:
    axes: dict[fx.Node, int | None] = {}
    for i in inputs:
        ishape = fake(i).shape
        aligned = axis - (len(shape) - len(ishape))
        if aligned < 0 or ishape[aligned] == 1:
            axes[i] = None
        elif ishape[aligned] == shape[axis]:
            axes[i] = aligned
        else:
            return None
    return axes


def _axes_of(node: fx.Node) -> range:
    value = fake(node)
    return range(value.dim()) if isinstance(value, torch.Tensor) else range(3)  # attention's tuple


@dataclasses.dataclass
class Region:
    """Nodes computed piece by piece: ``axis`` maps each to the axis its pieces are cut along
    (``given``: nodes whose pieces the ring supplies); ``count`` pieces in all."""

    axis: dict[fx.Node, int]
    count: int
    given: frozenset[fx.Node] = frozenset()

    @property
    def computed(self) -> list[fx.Node]:
        return [n for n in self.axis if n not in self.given]

    def outside_users(self, node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if u not in self.axis]

    def describe(self) -> str:
        return ", ".join(n.name for n in self.computed)


def forward_region(graph: fx.Graph, site: Site, given: dict[fx.Node, int], count: int, reserved: set[fx.Node]) -> Region | None:
    """The row-local ops after a Flash-AG site's matmuls (``given``: their outputs, with the
    axis their pieces are cut along), or None if there is nothing to compute there."""
    depends_on_ring = _descendants(site.wait)
    axis = dict(given)
    for node in graph.nodes:
        if node in axis or node in reserved or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if not any(i in axis for i in inputs):
            continue
        for candidate in _axes_of(node):
            cut = input_axes(node, candidate, count)
            if cut is not None and all(
                cut[i] == axis[i] if i in axis else i not in depends_on_ring for i in inputs
            ):
                axis[node] = candidate
                break
    return _trimmed(Region(axis, count, frozenset(given)), downstream=True) if len(axis) > len(given) else None


def backward_region(
    roots: dict[fx.Node, int], count: int, reserved: set[fx.Node], read_whole: Iterable[fx.Node], notes: list[str]
) -> Region | None:
    """The row-local ops producing a Flash-RS site's matmul operands (``roots``, with the axis
    their pieces are cut along), or None if there is nothing to compute there or it would form
    a cycle (a value assembled after the ring feeding the ring; said in ``notes``).
    ``read_whole``: the other inputs of the ring's matmuls."""
    axis: dict[fx.Node, int] = {}
    stack = list(roots.items())
    while stack:
        node, along = stack.pop()
        if node in axis:
            if axis[node] != along:
                notes.append(f"not fused: {node.name} would be cut along two dims")
                return None
            continue
        cut = input_axes(node, along, count) if node.op == "call_function" and node not in reserved else None
        if cut is None:
            continue  # a leaf: sliced
        axis[node] = along
        stack += [(i, a) for i, a in cut.items() if a is not None]
        if node.target is SDPA:  # both outputs are computed per piece
            stack += [(u, along) for u in node.users]
    region = _trimmed(Region(axis, count), downstream=False) if axis else None
    if region is None or any(u.target is not operator.getitem for n in region.axis if n.target is SDPA for u in n.users):
        return None
    outside = {i for n in region.axis for i in n.all_input_nodes if i not in region.axis} | set(read_whole)
    if cycle := set(region.axis) & _ancestors(outside):
        notes.append(f"not fused: {min(n.name for n in cycle)} is also needed whole before the ring")
        return None
    return region


def _trimmed(region: Region, downstream: bool) -> Region | None:
    """Keep the compute and the views between it and the ring; drop views that only lead out
    of the region (viewing the assembled value is as good) or only into it from outside
    (slicing the input is as good). None if no compute is left."""
    graph = next(iter(region.axis)).graph
    order = [n for n in graph.nodes if n in region.axis and n not in region.given]
    kept: set[fx.Node] = set()
    for node in reversed(order) if downstream else order:
        near = node.users if downstream else node.all_input_nodes
        if node.target not in VIEWS or any(n in kept for n in near):
            kept.add(node)
    kept |= {n for n in order if n.target is operator.getitem and n.args[0] in kept}  # attention's outputs
    if all(n.target in VIEWS for n in kept):
        return None
    return Region({n: a for n, a in region.axis.items() if n in kept or n in region.given}, region.count, region.given)


def _descendants(node: fx.Node) -> set[fx.Node]:
    return _reachable([node], lambda n: n.users)


def _ancestors(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    return _reachable(nodes, lambda n: n.all_input_nodes)


def _reachable(nodes: Iterable[fx.Node], step) -> set[fx.Node]:
    """Every node reached from ``nodes`` by following ``step`` (users or inputs)."""
    seen, stack = set(), list(nodes)
    while stack:
        for near in step(stack.pop()):
            if near not in seen:
                seen.add(near)
                stack.append(near)
    return seen


class Pieces:
    """Emits a region's nodes on piece q (memoised), and puts read-outside values back together."""

    def __init__(self, region: Region):
        self.region = region
        self.values: dict[tuple[fx.Node, int], fx.Node] = {}
        self.slices: dict[tuple[fx.Node, int, int], fx.Node] = {}

    def give(self, node: fx.Node, q: int, value: fx.Node) -> None:
        self.values[node, q] = value

    def value(self, emit: Emitter, node: fx.Node, q: int) -> fx.Node:
        if (node, q) not in self.values:
            self.values[node, q] = self._emit(emit, node, q)
        return self.values[node, q]

    def compute(self, emit: Emitter, q: int) -> list[fx.Node]:
        """Every region node on piece q; returns the pieces read outside the region."""
        for node in self.region.computed:
            self.value(emit, node, q)
        return [self.values[n, q] for n in self.region.computed if self.region.outside_users(n)]

    def assemble(self, emit: Emitter) -> None:
        """Replace each region value read outside the region by its pieces, concatenated."""
        for node in self.region.computed:
            readers = self.region.outside_users(node)
            if readers and node.target is not SDPA:
                parts = [self.value(emit, node, q) for q in range(self.region.count)]
                whole = emit(aten.cat.default, parts, self.region.axis[node])
                node.replace_all_uses_with(whole, delete_user_cb=lambda user: user in readers)

    def piece(self, emit: Emitter, node: fx.Node, axis: int, q: int) -> fx.Node:
        """Piece q of ``node``: computed if it is in the region, else sliced along ``axis``."""
        return self.value(emit, node, q) if node in self.region.axis else self.slice(emit, node, axis, q)

    def slice(self, emit: Emitter, node: fx.Node, axis: int, q: int) -> fx.Node:
        if (node, axis, q) not in self.slices:
            size = fake(node).shape[axis] // self.region.count
            self.slices[node, axis, q] = emit(aten.slice.Tensor, node, axis, q * size, (q + 1) * size)
        return self.slices[node, axis, q]

    def _emit(self, emit: Emitter, node: fx.Node, q: int) -> fx.Node:
        along = self.region.axis[node]
        cut = input_axes(node, along, self.region.count)

        def piece_of(arg: fx.Node) -> fx.Node:
            return arg if cut[arg] is None else self.piece(emit, arg, cut[arg], q)

        args, kwargs = fx.node.map_arg((node.args, node.kwargs), piece_of)
        if node.target in RESHAPES or node.target is aten.expand.default:  # to the piece's shape
            shape = list(fake(node).shape)
            shape[along] //= self.region.count
            # (a piece may be a non-contiguous slice: reshape, not view)
            return emit(aten.expand.default if node.target is aten.expand.default else aten.reshape.default, args[0], shape)
        if node.target is SDPA and along == 2:
            return _query_split(emit, node, args, kwargs, q, self.region.count)
        return emit(node.target, *args, **kwargs)


def _query_split(emit: Emitter, node: fx.Node, args: tuple, kwargs: dict, q: int, count: int) -> fx.Node:
    """Attention of query rows [s, e): causal, only keys [0, e) are visible, and key j to row i
    exactly when j <= s + i: an explicit mask (``is_causal`` would align it to row 0)."""
    query, key, value, *rest = args
    causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    if not causal:
        return emit(SDPA, query, key, value, *rest, **kwargs)
    length = fake(node.args[0]).shape[2] // count
    start, end = q * length, (q + 1) * length
    key, value = (emit(aten.slice.Tensor, t, 2, 0, end) for t in (key, value))
    device, dtype = fake(query).device, fake(query).dtype

    def positions(begin: int, size: int) -> fx.Node:
        return emit(torch.ops.prims.iota.default, size, start=begin, step=1, dtype=torch.int64, device=device, requires_grad=False)

    future = emit(aten.gt.Tensor, positions(0, end), emit(aten.reshape.default, positions(start, length), [length, 1]))
    blocked, visible = (emit(aten.full.default, [], v, dtype=dtype, device=device) for v in (float("-inf"), 0.0))
    mask = emit(aten.where.self, future, blocked, visible)
    others = {k: v for k, v in kwargs.items() if k not in ("dropout_p", "is_causal")}
    return emit(SDPA, query, key, value, 0.0, False, **others, attn_mask=mask)


def reserved_nodes(sites: Iterable[Site]) -> set[fx.Node]:
    """Nodes that belong to a site (collectives, the gathered / scattered tensor, the matched
    matmuls and the views and sums around them): never fused into another site's ring."""
    nodes: set[fx.Node] = set()
    for site in sites:
        nodes |= {site.collective, site.wait, site.tensor}
        for consumer in site.consumers:
            nodes |= {consumer.mm, *consumer.views, *consumer.permutes}
        if site.pattern == "mm→reduce_scatter" and site.tensor is not None:
            stack = [site.tensor]  # the reshapes and adds joining the terms
            while stack:
                node = stack.pop()
                nodes.add(node)
                if node.target in RESHAPES or node.target is aten.add.Tensor:
                    stack += node.all_input_nodes
    nodes.discard(None)
    return nodes


def _record(site: Site, region: Region | None) -> Pieces | None:
    """Note a fused region on its site; the emitter of its pieces (None: nothing fused)."""
    if region is None:
        return None
    site.fused += region.computed
    attention = " (query-split attention)" if any(n.target is SDPA and a == 2 for n, a in region.axis.items()) else ""
    site.notes.append(f"fused into the steps{attention}: {region.describe()}")
    return Pieces(region)


class GatherFusion:
    """Flash-AG: the region after the site's row consumers, computed piece by piece."""

    def __init__(self, site: Site, count: int, region: Region | None, seeds: list[list[fx.Node]]):
        self.site, self.count, self.seeds = site, count, seeds
        self.pieces = _record(site, region)

    @classmethod
    def build(cls, graph: fx.Graph, site: Site, count: int, reserved: set[fx.Node], enabled: bool) -> GatherFusion:
        leading = list(fake(site.tensor).shape[:-1])
        seeds: list[list[fx.Node]] = []
        for consumer in site.consumers:
            if consumer.role != "rows":
                seeds.append([])
            elif site.dim == 0:  # the matmul's output rows: pieces are row blocks
                seeds.append([consumer.mm])
            else:  # rows of pieces are not a block until the output is viewed as [*leading, M]
                shape = [*leading, fake(consumer.mm).shape[1]]
                seeds.append([u for u in consumer.mm.users if u.target in RESHAPES and list(fake(u).shape) == shape])
        given = {node: site.dim for nodes in seeds for node in nodes}
        region = forward_region(graph, site, given, count, reserved) if enabled and given else None
        return cls(site, count, region, seeds)

    def step(self, emit: Emitter, q: int, outputs: list[fx.Node | None]) -> list[fx.Node]:
        """Compute the region on piece q from the consumers' outputs of piece q (in layout);
        returns the nodes to pin before the step's wait."""
        if self.pieces is None:
            return []
        for nodes, output in zip(self.seeds, outputs):
            for node in nodes:
                self.pieces.give(node, q, output)
        return self.pieces.compute(emit, q)

    def finish(self, emit: Emitter) -> None:
        if self.pieces is not None:
            self.pieces.assemble(emit)


class ScatterFusion:
    """Flash-RS: the region producing the site's matmul inputs, computed piece by piece."""

    def __init__(self, site: Site, count: int, region: Region | None, roots: list[tuple[fx.Node, int] | None]):
        self.site, self.count, self.roots = site, count, roots
        self.pieces = _record(site, region)

    @classmethod
    def build(cls, site: Site, count: int, reserved: set[fx.Node], enabled: bool) -> ScatterFusion:
        leading = list(fake(site.tensor).shape[:-1])
        roots: list[tuple[fx.Node, int] | None] = []
        for term in site.consumers:
            rows = left_operand(term.mm)
            if site.dim == 0:
                roots.append((rows, 0))
            elif rows.target in RESHAPES and list(fake(rows.args[0]).shape[:-1]) == leading:
                roots.append((rows.args[0], site.dim))  # [*leading, K]: pieces are blocks of dim d
            else:
                roots.append(None)
        read_whole = [right_operand(t.mm) for t in site.consumers]
        read_whole += [t.mm.args[0] for t in site.consumers if t.mm.target is ADDMM and t.role != "product"]
        given = dict(r for r in roots if r is not None)
        region = backward_region(given, count, reserved, read_whole, site.notes) if enabled and given else None
        return cls(site, count, region, roots)

    def rows(self, emit: Emitter, t: int, pieces: list[int]) -> fx.Node:
        """The rows of term t's left operand that belong to ``pieces`` (2-D, in that order)."""
        term, root = self.site.consumers[t], self.roots[t]
        if self.pieces is None or root is None:
            return rows_of_pieces(emit, left_operand(term.mm), self.site, pieces, self.count)
        node, axis = root
        for q in pieces:  # the whole region, also what only outside readers need (attention's logsumexp)
            self.pieces.compute(emit, q)
        joined = join(emit, [self.pieces.piece(emit, node, axis, q) for q in pieces], axis)
        return joined if fake(joined).dim() == 2 else emit(aten.reshape.default, joined, [-1, fake(node).shape[-1]])

    def finish(self, emit: Emitter) -> None:
        if self.pieces is not None:
            self.pieces.assemble(emit)


@dataclasses.dataclass
class Fuse:
    """What a rewrite needs to fuse: whether fusion is on, and every site's own nodes."""

    enabled: bool
    reserved: set[fx.Node]

    def after_gather(self, graph: fx.Graph, site: Site, count: int) -> GatherFusion:
        self._drop_replaced(graph)
        return GatherFusion.build(graph, site, count, self.reserved, self.enabled)

    def before_scatter(self, graph: fx.Graph, site: Site, count: int) -> ScatterFusion:
        self._drop_replaced(graph)
        return ScatterFusion.build(site, count, self.reserved, self.enabled)

    def _drop_replaced(self, graph: fx.Graph) -> None:
        if self.enabled:  # what earlier rewrites replaced would read like an outside user
            stable_topological_sort(graph)  # (new nodes are placed before their first reader)
            graph.eliminate_dead_code()
