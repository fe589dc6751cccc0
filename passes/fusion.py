"""Fusion: the row-local ops next to a ring, computed inside its steps.

A ring step computes one piece q of rows (piece q of the gathered / scattered dim). An op whose
output rows depend only on the same rows of its inputs can be computed on that piece too, so
more compute overlaps each transfer.

After Flash-AG (:func:`~.regions.forward_region`). Before (SwiGLU after a sequence gather)::

    y1 = mm(view(G), W1); y3 = mm(view(G), W3)
    h = silu(view(y1)) * view(y3)          # row-local
    z = mm(view(h), W2)                    # a reduce-scatter's matmul: another site, stops here

After: step k computes y1_q, y3_q, then h_q = silu(view(y1_q)) * view(y3_q) for the piece it
holds; what is read after the region (``h`` by ``z``, ``y1`` saved for backward) is put back
together once, in tensor order: h = cat(h_0, ..., h_{count-1}).

Before Flash-RS (:func:`~.regions.backward_region`). Before::

    a = sdpa(q, k, v, causal)[0];  o = reduce_scatter(mm(view(permute(a)), Wo))

After: step i computes the rows of piece q of the matmul's left operand from the pieces of its
own inputs instead of slicing them out of the full tensor. Attention is row-local in the query
dim: on query rows [s, e) it is ``sdpa(q[s:e], k[:e], v[:e])`` with the causal mask offset by
s (the paper's query-split attention); its outputs saved for backward are assembled once.

The concepts live apart: which ops are row-local (:mod:`.rowlocal`, attention in
:mod:`.attention`), which nodes form a region (:mod:`.regions`) and how a region is emitted
piece by piece (:mod:`.pieces`). This module ties them to a site's ring: what the ring gives a
region (its matmuls' output pieces) and what it takes from one (its matmuls' input rows).
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from .attention import is_attention
from .attention_backward import ATTENTION_BACKWARD, is_attention_backward
from .chunks import join, rows_of_pieces
from .graph_utils import ADDMM, RESHAPES, SCALED_MM, Emitter, aten, fake, left_operand, right_operand, same_shape
from .pieces import Pieces
from .regions import Region, backward_region, forward_region
from .site import Site


def _record(site: Site, region: Region | None) -> Pieces | None:
    """Note a fused region on its site; the emitter of its pieces (None: nothing fused)."""
    if region is None:
        return None
    site.fused += region.computed
    site.notes.append(f"fused into the steps{attention_note(region)}: {region.describe()}")
    return Pieces(region)


def attention_note(region: Region) -> str:
    """How the region cuts attention, for a site's note ("" if it holds none)."""
    note = " (query-split attention)" if any(is_attention(n) and a == 2 for n, a in region.axis.items()) else ""
    return note + (" (attention backward by query block)" if any(map(is_attention_backward, region.axis)) else "")

class GatherFusion:
    """Flash-AG: the region after the site's row consumers, computed piece by piece."""

    def __init__(self, site: Site, count: int, region: Region | None, seeds: list[list[fx.Node]]):
        self.site, self.count, self.seeds = site, count, seeds
        self.pieces = _record(site, region)

    @classmethod
    def build(cls, site: Site, count: int, reserved: set[fx.Node], enabled: bool) -> GatherFusion:
        leading = list(fake(site.tensor).shape[:-1])
        seeds: list[list[fx.Node]] = []
        for consumer in site.consumers:
            if consumer.role != "rows":
                seeds.append([])
            elif site.dim == 0:  # the matmul's output rows: pieces are row blocks
                seeds.append([consumer.mm])
            else:  # rows of pieces are not a block until the output is viewed as [*leading, M]
                shape = [*leading, fake(consumer.mm).shape[1]]
                seeds.append([u for u in consumer.mm.users if u.target in RESHAPES and same_shape(fake(u).shape, shape)])
        given = {node: site.dim for nodes in seeds for node in nodes}
        # Attention's backward stays whole after Flash-AG (the TP + SP backward's dO gather):
        # each block's dK / dV is padded to its own length, a kernel of its own per piece, and
        # a Llama block's kernels are held not to grow with the group (tests/test_kernels.py).
        # Not yet done there; the all-to-all (Ulysses) cuts it.
        region = forward_region(site, given, count, reserved, stop_at=ATTENTION_BACKWARD) if enabled and given else None
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
        by_columns = 0 < site.dim == len(leading)  # scattered by columns: the left operands are read whole
        for term in site.consumers:
            rows = left_operand(term.mm)
            if by_columns:
                roots.append(None)
            elif site.dim == 0:
                roots.append((rows, 0))
            elif rows.target in RESHAPES and same_shape(fake(rows.args[0]).shape[:-1], leading):
                roots.append((rows.args[0], site.dim))  # [*leading, K]: pieces are blocks of dim d
            else:
                roots.append(None)
        read_whole = [right_operand(t.mm) for t in site.consumers]
        read_whole += [t.mm.args[0] for t in site.consumers if t.mm.target is ADDMM and t.role != "product"]
        read_whole += [scale for t in site.consumers if t.mm.target is SCALED_MM for scale in t.mm.args[2:4]]  # (cut as rows of the whole)
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

    def after_gather(self, site: Site, count: int) -> GatherFusion:
        return GatherFusion.build(site, count, self.reserved, self.enabled)

    def before_scatter(self, site: Site, count: int) -> ScatterFusion:
        return ScatterFusion.build(site, count, self.reserved, self.enabled)
