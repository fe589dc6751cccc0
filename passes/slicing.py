"""The data-slicing baseline (Megatron / MindSpeed style), the schedule the paper compares with.

All-gather → matmul. Before: ``y = mm(view(all_gather(x)), W)``. After, with K slices (piece s
of every rank's shard travels in collective s)::

    x_0, ..., x_{K-1} = slices of x along d
    g_0 = all_gather(x_0)
    for s in 0 .. K-1:
        if s < K-1: g_{s+1} = all_gather(x_{s+1})        # start: overlaps slice s's matmul
        y_s = mm(view(wait(g_s)), W)                    # rows of pieces (0, s), ..., (N-1, s)
    y = the pieces of y_0 .. y_{K-1} put back in tensor order

The first gather has nothing to hide behind: about 1/K of the communication stays exposed.

Matmul → reduce-scatter. After::

    for s in 0 .. K-1:
        p_s = mm(A[rows of pieces (0, s), ..., (N-1, s)], B)   # overlaps slice s-1's collective
        o_s = reduce_scatter(p_s)                             # start
    o = cat(wait(o_0), ..., wait(o_{K-1}))                     # slice K-1's collective is the tail
"""

from __future__ import annotations

import torch.fx as fx

from .chunks import (
    cut,
    emitter_before_consumers,
    finish_all_gather,
    finish_reduce_scatter,
    in_layout,
    matmul_like,
    output_axis,
    piece_product,
    piece_shape,
    shard_pieces,
    sum_nodes,
)
from .fusion import Fuse
from .graph_utils import ALL_GATHER, REDUCE_SCATTER, WAIT, Emitter, aten, fake
from .site import RingStep, Site


def sliced_all_gather(graph: fx.Graph, site: Site, fuse: Fuse) -> None:
    n, d, k, group = site.group_size, site.dim, site.chunks_per_rank, site.group_name
    count = n * k
    emit = emitter_before_consumers(graph, site)
    fused = fuse.after_gather(graph, site, count)
    slices = shard_pieces(emit, site, k)
    gathers = [emit(ALL_GATHER, slices[0], n, group)]
    held: list[fx.Node | None] = [None] * count
    outputs = [[None] * count for _ in site.consumers]
    partials = [[] for _ in site.consumers]
    waits = [emit(WAIT, gathers[0])]  # slice 0: exposed
    for s in range(k):
        if s < k - 1:
            gathers.append(emit(ALL_GATHER, slices[s + 1], n, group))
        gathered = _in_dim_layout(emit, waits[s], n, d)  # pieces (0, s) .. (N-1, s) along d
        pieces = [q * k + s for q in range(n)]
        for q, piece in zip(pieces, cut(emit, gathered, d, n)):
            held[q] = piece
        compute = []
        for c, consumer in enumerate(site.consumers):
            y = piece_product(emit, consumer, site, gathered, pieces, count)
            compute.append(y)
            if consumer.role == "contraction":
                partials[c].append(y)
            else:
                laid_out = in_layout(emit, consumer, y, gathered, d)
                for q, part in zip(pieces, cut(emit, laid_out, output_axis(consumer, d), n)):
                    outputs[c][q] = part
        for q in pieces:
            compute += fused.step(emit, q, [out[q] for out in outputs])
        wait = emit(WAIT, gathers[s + 1]) if s < k - 1 else None
        site.steps.append(RingStep(chunk=s, compute=compute, start=gathers[s + 1] if s < k - 1 else None, wait=wait))
        if wait is not None:
            waits.append(wait)
    fused.finish(emit)
    finish_all_gather(emit, site, outputs, partials, held)


def sliced_reduce_scatter(graph: fx.Graph, site: Site, fuse: Fuse) -> None:
    n, k, group = site.group_size, site.chunks_per_rank, site.group_name
    count = n * k
    emit = Emitter(graph, before=site.wait)
    fused = fuse.before_scatter(graph, site, count)
    scatters: list[fx.Node] = []
    results: list[fx.Node] = []
    for s in range(k):
        pieces = [q * k + s for q in range(n)]
        compute = [matmul_like(emit, term, fused.rows(emit, t, pieces)) for t, term in enumerate(site.consumers)]
        product = sum_nodes(emit, compute)
        previous = scatters[-1] if scatters else None
        wait = emit(WAIT, previous) if previous is not None else None  # after this slice's matmul
        if wait is not None:
            results.append(wait)
        site.steps.append(RingStep(chunk=s, compute=compute, start=previous, wait=wait))
        scatters.append(emit(REDUCE_SCATTER, _stacked(emit, product, site, n), "sum", n, group))
    results.append(emit(WAIT, scatters[-1]))  # the tail
    fused.finish(emit)
    finish_reduce_scatter(emit, site, results, count)


def _in_dim_layout(emit: Emitter, gathered: fx.Node, n: int, d: int) -> fx.Node:
    """all_gather stacks the ranks' pieces on dim 0; put them side by side along d."""
    return gathered if d == 0 else emit(aten.cat.default, cut(emit, gathered, 0, n), d)


def _stacked(emit: Emitter, product: fx.Node, site: Site, n: int) -> fx.Node:
    """The rows of pieces (0, s) .. (N-1, s), stacked on dim 0 as reduce_scatter cuts them."""
    if site.dim == 0:
        return product
    shape = piece_shape(site, site.chunks_per_rank)  # n pieces side by side along d
    laid_out = emit(aten.reshape.default, product, shape[:-1] + [fake(product).shape[-1]])
    return emit(aten.cat.default, cut(emit, laid_out, site.dim, n), 0)
