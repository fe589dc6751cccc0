"""The CommFuse rings: Flash-AG and Flash-RS, one-way or bidirectional, m pieces per chunk.

Flash-AG. Before (G is the gathered tensor, chunk j = rank j's shard along dim d)::

    G = all_gather(x) [-> split/cat to dim d]                   # N chunks along d
    y = mm(view(G, [R, K]), W)                                   # one or more consumers

After (rank r; one-way ring, m = 1)::

    cur = x                                   # chunk r
    for k in 0 .. N-1:
        j = (r - k) % N
        if k < N-1: nxt = ring_exchange(cur, to=r+1, from=r-1)   # start
        y_j = mm(view(cur, [-1, K]), W)                          # overlaps the transfer
        if k < N-1: cur = wait_tensor(nxt)                       # chunk j-1
    y = view(cat([y_0, ..., y_{N-1}], d), [R, M])   # each chunk at its own offset
    G = cat([x_0, ..., x_{N-1}], d)                 # only if G has other readers (saved for bw)

Flash-RS. Before (P is a sum of matmul terms, scattered in chunks along dim d)::

    o = wait_tensor(reduce_scatter([split/cat of] view(mm(A_1, B_1) + ... ), "sum", N, group))

After::

    for i in 0 .. N-1:
        j = (r - 1 - i) % N
        p = mm(A_1[rows of chunk j], B_1) + ... + mm(A_t[rows of chunk j], B_t)
        if i > 0: p = p + wait_tensor(acc)     # partial sum of chunk j from ranks < r
        if i < N-1: acc = ring_exchange(p, to=r+1, from=r-1)   # overlaps the next step
    o = view(p, shape of o)                    # j = r at the last step: own chunk, no tail

Pieces and directions. With ``chunks_per_rank`` m each chunk is cut into m pieces along d and
every piece travels the ring on its own (piece s of chunk j is piece q = j·m + s of the
tensor): each step becomes m sub-steps with m times smaller transfers. The bidirectional ring
cuts each chunk into 2m pieces; pieces m..2m-1 travel the other way (to r-1, from r+1), so at
step k they hold chunk (r + k) % N (Flash-RS: compute chunk (r + 1 + i) % N) and both links of
a rank are busy. The sub-steps of the two directions start together, compute, then wait.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from commfuse_compile.cost_model import ring_substeps

from .chunks import (
    emitter_before_consumers,
    finish_all_gather,
    finish_reduce_scatter,
    in_layout,
    matmul_like,
    piece_product,
    shard_pieces,
    sum_nodes,
)
from .fusion import Fuse
from .graph_utils import WAIT, Emitter, aten
from .site import RingStep, Site


def _exchange_op():
    import commfuse_compile.p2p  # noqa: F401  (registers torch.ops.commfuse.ring_exchange)

    return torch.ops.commfuse.ring_exchange.default


def flash_all_gather(graph: fx.Graph, site: Site, r: int, tags: itertools.count, fuse: Fuse) -> None:
    n, d, group = site.group_size, site.dim, site.group_name
    substeps = ring_substeps(site.schedule, site.chunks_per_rank)
    per_chunk = sum(len(sub) for sub in substeps)
    count = n * per_chunk
    emit = emitter_before_consumers(graph, site)
    fused = fuse.after_gather(graph, site, count)
    exchange = _exchange_op()
    cur = dict(enumerate(shard_pieces(emit, site, per_chunk)))  # piece -> node holding it
    held: list[fx.Node | None] = [None] * count
    outputs = [[None] * count for _ in site.consumers]
    partials = [[] for _ in site.consumers]  # contraction consumers, in ring order
    for k in range(n):
        for sub in substeps:
            q = {piece: ((r - direction * k) % n) * per_chunk + piece for piece, direction in sub}
            starts = {
                piece: emit(exchange, cur[piece], (r + direction) % n, (r - direction) % n, group, next(tags))
                for piece, direction in sub
                if k < n - 1
            }
            computed = {piece: [] for piece, _ in sub}
            for piece, _ in sub:
                held[q[piece]] = cur[piece]
                for c, consumer in enumerate(site.consumers):
                    y = piece_product(emit, consumer, site, cur[piece], [q[piece]], count)
                    computed[piece].append(y)
                    if consumer.role == "contraction":
                        partials[c].append(y)
                    else:
                        outputs[c][q[piece]] = in_layout(emit, consumer, y, cur[piece], d)
                computed[piece] += fused.step(emit, q[piece], [out[q[piece]] for out in outputs])
            for piece, _ in sub:
                wait = emit(WAIT, starts[piece]) if piece in starts else None
                site.steps.append(RingStep(chunk=q[piece], compute=computed[piece], start=starts.get(piece), wait=wait))
                if wait is not None:
                    cur[piece] = wait
    fused.finish(emit)
    finish_all_gather(emit, site, outputs, partials, held)


def flash_reduce_scatter(graph: fx.Graph, site: Site, r: int, tags: itertools.count, fuse: Fuse) -> None:
    n, group = site.group_size, site.group_name
    substeps = ring_substeps(site.schedule, site.chunks_per_rank)
    per_chunk = sum(len(sub) for sub in substeps)
    count = n * per_chunk
    emit = Emitter(graph, before=site.wait)
    fused = fuse.before_scatter(graph, site, count)
    exchange = _exchange_op()
    acc: dict[int, fx.Node | None] = {piece: None for sub in substeps for piece, _ in sub}  # in flight from r-dir
    own: dict[int, fx.Node] = {}
    for i in range(n):
        for sub in substeps:
            partial = {}
            for piece, direction in sub:
                q = ((r - direction * (1 + i)) % n) * per_chunk + piece
                compute = [matmul_like(emit, term, fused.rows(emit, t, [q])) for t, term in enumerate(site.consumers)]
                partial[piece] = (q, compute, sum_nodes(emit, compute))
            for piece, direction in sub:
                q, compute, p = partial[piece]
                wait = emit(WAIT, acc[piece]) if acc[piece] is not None else None
                if wait is not None:
                    p = emit(aten.add.Tensor, p, wait)
                site.steps.append(RingStep(chunk=q, compute=compute, start=acc[piece], wait=wait))
                partial[piece] = (q, compute, p)
            for piece, direction in sub:
                p = partial[piece][2]
                if i < n - 1:
                    acc[piece] = emit(exchange, p, (r + direction) % n, (r - direction) % n, group, next(tags))
                else:
                    own[piece] = p  # the last step computes this rank's own chunk: no tail
    fused.finish(emit)
    finish_reduce_scatter(emit, site, [own[piece] for piece in sorted(own)], count)
