"""Attention as a row-local op: which cuts of ``sdpa`` are exact, and query-split attention.

CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``, outputs out
[B, H, L, E] and logsumexp [B, H, L]) is row-local in batch and heads (q, k, v cut alike) and,
without dropout or a mask, in the queries: on query rows [s, e) it is attention over keys
[0, e) with the causal mask offset by s — the paper's query-split attention, which lets the
output projection's Flash-RS (or Ulysses' all-to-all back) compute attention one query piece
per step. Causal, that is two calls without a mask, merged by their logsumexps: the keys
[0, s) every row sees, and the square block [s, e), causal as it stands (an explicit mask
instead costs 2.6x the whole op's time here: the masked blocks are not skipped).
"""

from __future__ import annotations

import operator

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


def query_split(emit: Emitter, node: fx.Node, args: tuple, kwargs: dict, q: int, count: int) -> fx.Node | tuple[fx.Node, fx.Node]:
    """Attention of query rows [s, e): the op itself on full attention and on the first piece;
    causal otherwise, (out, logsumexp) of the diagonal block merged with the keys before it."""
    query, key, value, *rest = args
    causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    if not causal:
        return emit(SDPA, query, key, value, *rest, **kwargs)
    length = fake(node.args[0]).shape[2] // count
    start, end = q * length, (q + 1) * length
    others = {k: v for k, v in kwargs.items() if k not in ("dropout_p", "is_causal")}

    def attend(begin: int, stop: int, causal: bool) -> tuple[fx.Node, fx.Node]:
        key_block, value_block = (emit(aten.slice.Tensor, t, 2, begin, stop) for t in (key, value))
        call = emit(SDPA, query, key_block, value_block, 0.0, causal, **others)
        return emit(operator.getitem, call, 0), emit(operator.getitem, call, 1)

    diagonal = attend(start, end, True)
    if start == 0:
        return diagonal
    return _merged(emit, attend(0, start, False), diagonal, fake(query).dtype)


def _merged(emit: Emitter, first: tuple[fx.Node, fx.Node], second: tuple[fx.Node, fx.Node], dtype: torch.dtype) -> tuple[fx.Node, fx.Node]:
    """Attention over two disjoint key sets from each one's (out, logsumexp): the softmax
    weights renormalised, lse = log(e^lse1 + e^lse2), out = Σ out_i·e^(lse_i − lse), in fp32."""
    (out1, lse1), (out2, lse2) = first, second
    top = emit(aten.maximum.default, lse1, lse2)  # (log-sum-exp from the larger: no overflow)
    spread = emit(aten.add.Tensor, *(emit(aten.exp.default, emit(aten.sub.Tensor, part, top)) for part in (lse1, lse2)))
    lse = emit(aten.add.Tensor, top, emit(aten.log.default, spread))

    def weighted(out: fx.Node, part: fx.Node) -> fx.Node:
        weight = emit(aten.unsqueeze.default, emit(aten.exp.default, emit(aten.sub.Tensor, part, lse)), -1)
        return emit(aten.mul.Tensor, emit(torch.ops.prims.convert_element_type.default, out, torch.float32), weight)

    out = emit(aten.add.Tensor, weighted(out1, lse1), weighted(out2, lse2))
    return emit(torch.ops.prims.convert_element_type.default, out, dtype), lse
