"""Attention's backward split by query block: dQ row-local, dK and dV summed over the blocks.

The backward of fused attention takes the output gradient dO, q, k, v, the forward's out and
logsumexp and returns (dQ, dK, dV). With the logsumexp and out of the *whole* row passed in,
every term it sums is exact on any subset of the queries or of the keys::

    P_ij = exp(q_i·k_j·scale − lse_i)        (the row's softmax: lse is the whole row's)
    D_i  = dO_i · out_i
    dQ_i = Σ_j P_ij (dO_i·v_j − D_i) k_j·scale
    dK_j = Σ_i P_ij (dO_i·v_j − D_i) q_i·scale      dV_j = Σ_i P_ij dO_i

so query block [s, e) is one call on (dO, q, out, lse)[s:e] and the whole k, v: its dQ is
block [s, e) of dQ, and its dK, dV are that block's share of the sums over i, added up over
the blocks as the K-dim all-gather adds its partial products. Causal, the block sees keys
[0, e): the diagonal block [s, e) causal (square: the mask's alignment does not matter) plus,
for s > 0, keys [0, s) in full; their dQs add, their dK, dV cover keys [0, s) and [s, e).

This lets the all-to-all that brings dO (Ulysses' backward) compute attention's backward one
arriving block at a time. Only the CPU flash backward is cut: the CUDA backward ops are
computed whole (not yet split).

Before (one node, whole sequence)::

    dq, dk, dv = flash_backward(dO, q, k, v, out, lse, causal)

After (block p of N, rows [s, e))::

    dq_p, dk_p, dv_p = flash_backward(dO[s:e], q[s:e], k[s:e], v[s:e], out[s:e], lse[s:e], causal)
    dq_p', dk_p', dv_p' = flash_backward(dO[s:e], q[s:e], k[:s], v[:s], out[s:e], lse[s:e])
    dq[s:e] = dq_p + dq_p'
    dk += pad(cat(dk_p', dk_p), to S)       (summed over the blocks in fp32)
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch.fx as fx

from .attention import arguments, call
from .graph_utils import Emitter, aten, fake, same_size, sum_in_fp32

CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
ATTENTION_BACKWARD = frozenset({CPU_FLASH_BACKWARD})
# (computed whole, with a note: not yet cut)
UNCUT_BACKWARD = frozenset(
    {
        aten._scaled_dot_product_flash_attention_backward.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
        aten._scaled_dot_product_cudnn_attention_backward.default,
    }
)
DQ, DK, DV = 0, 1, 2
CUT = ("grad_out", "out", "logsumexp")  # with the query: cut by query rows; key, value read whole


def is_attention_backward(node: Any) -> bool:
    """An attention backward op that can be cut by query block."""
    return isinstance(node, fx.Node) and node.target in ATTENTION_BACKWARD


def is_any_attention_backward(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.target in ATTENTION_BACKWARD | UNCUT_BACKWARD


def backward_axes(node: fx.Node, axis: int) -> dict[fx.Node, int | None] | None:
    """How to cut the inputs for query block pieces (output ``axis`` 2) of an attention
    backward: dO, q, out and logsumexp by rows, k and v read whole. None for any other axis, or
    where no cut is exact: dropout, a mask, fewer or more keys than queries, or an input read
    both cut and whole (the same tensor as two operands)."""
    if axis != 2:
        return None
    named = arguments(node.target, node.args, node.kwargs)
    q, k, v = named["query"], named["key"], named["value"]
    cut = [named[name] for name in CUT]
    if named["dropout_p"] or named.get("attn_mask") is not None or len({q, k, v, *cut}) < 6:
        return None
    if not same_size(fake(q).shape[2], fake(k).shape[2]):
        return None
    return {q: 2, k: None, v: None, **{t: 2 for t in cut}}


def backward_refusal(node: fx.Node, axis: int) -> str:
    """Why :func:`backward_axes` cuts no input of ``node`` along output ``axis``."""
    if node.target in UNCUT_BACKWARD:
        return "the CUDA attention backward ops are not yet cut by query block"
    named = arguments(node.target, node.args, node.kwargs)
    if axis != 2:
        return f"its backward is cut only by query rows, not along dim {axis}"
    if named["dropout_p"]:
        return "dropout"
    if named.get("attn_mask") is not None:
        return "a mask (not yet cut in the backward)"
    return "as many keys as queries, and six different input tensors, are needed to cut its backward"


@dataclasses.dataclass
class BlockGradients:
    """Query block p's share of an attention backward: its rows of dQ, and its parts of dK, dV
    padded to the whole key length (zeros past the keys the block sees)."""

    dq: fx.Node
    dk: fx.Node
    dv: fx.Node

    def output(self, index: int) -> fx.Node:
        return (self.dq, self.dk, self.dv)[index]

    def nodes(self) -> list[fx.Node]:
        return [self.dq, self.dk, self.dv]


def query_block_backward(emit: Emitter, node: fx.Node, args: tuple, kwargs: dict, p: int, count: int) -> BlockGradients:
    """The backward of query rows [s, e) (``args`` hold block p of dO, q, out and lse; k and v
    whole): one call on every key (non-causal), or the causal diagonal block plus, past the
    first block, the keys before it in full."""
    named = arguments(node.target, args, kwargs)
    keys = fake(node.args[2]).shape[2]
    length = keys // count
    start, end = p * length, (p + 1) * length

    def gradients(begin: int, stop: int, causal: bool) -> tuple[fx.Node, fx.Node, fx.Node]:
        blocks = {name: emit(aten.slice.Tensor, named[name], 2, begin, stop) for name in ("key", "value")}
        grads = call(emit, node.target, {**named, **blocks, "is_causal": causal})
        return tuple(emit(operator.getitem, grads, i) for i in (DQ, DK, DV))

    if not named["is_causal"]:
        return BlockGradients(*gradients(0, keys, False))
    dq, dk, dv = gradients(start, end, True)
    if start:
        dq_before, dk_before, dv_before = gradients(0, start, False)
        dq = emit(aten.add.Tensor, dq, dq_before)
        dk, dv = (emit(aten.cat.default, [before, diagonal], 2) for before, diagonal in ((dk_before, dk), (dv_before, dv)))
    if end < keys:
        dk, dv = (emit(aten.constant_pad_nd.default, grad, [0, 0, 0, keys - end], 0.0) for grad in (dk, dv))
    return BlockGradients(dq, dk, dv)


def assembled_gradient(emit: Emitter, blocks: list[BlockGradients], index: int) -> fx.Node:
    """dQ (``index`` 0) from its query blocks; dK or dV summed over them, in fp32 (low-precision
    partial sums would round at every add where the whole op accumulates in fp32)."""
    if index == DQ:
        return emit(aten.cat.default, [b.dq for b in blocks], 2)
    parts = [b.output(index) for b in blocks]
    return sum_in_fp32(emit, parts, fake(parts[0]).dtype)
