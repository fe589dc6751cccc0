"""Attention as a row-local op: which cuts of ``sdpa`` are exact, and query-split attention.

CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``, outputs out
[B, H, L, E] and logsumexp [B, H, L]) is row-local in batch and heads (q, k, v cut alike) and,
without dropout or a mask, in the queries: on query rows [s, e) it is
``sdpa(q[s:e], k[:e], v[:e])`` with the causal mask offset by s — the paper's query-split
attention, which lets the output projection's Flash-RS compute attention one query piece per
step.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import Emitter, aten, fake, same_size

SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default


def attention_axes(node: fx.Node, axis: int) -> dict[fx.Node, int | None] | None:
    """CPU flash attention ``(q, k, v, dropout, is_causal, attn_mask=, scale=)``, outputs
    (out [B, H, L, E], logsumexp [B, H, L]): row-local in batch and heads (k, v cut alike) and,
    without dropout or a mask, in the queries (k, v read whole; see :func:`_query_split`)."""
    q, k, v = node.args[:3]
    dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    if dropout or node.kwargs.get("attn_mask") is not None or len({q, k, v}) < 3:
        return None
    if axis in (0, 1):
        return {q: axis, k: axis, v: axis}
    if axis == 2 and same_size(fake(q).shape[2], fake(k).shape[2]):
        return {q: 2, k: None, v: None}
    return None


def query_split(emit: Emitter, node: fx.Node, args: tuple, kwargs: dict, q: int, count: int) -> fx.Node:
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
