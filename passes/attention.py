"""Attention as a row-local op: which cuts of fused attention are exact, and query-split attention.

The fused attention ops (CPU flash; CUDA flash, memory-efficient and cuDNN) take q, k, v
[B, H, L, E] (and, but for flash, an optional mask or bias broadcast to [B, H, L, S]) and
return (out [B, H, L, E], logsumexp over the keys, then per-call values: RNG state, sizes).
Without dropout they are row-local in batch and heads (q, k, v and the mask cut alike) and,
where a head's keys are the same for every query row, in the queries: on query rows [s, e)
the op is attention over keys [0, e) with the causal diagonal offset by s — the paper's
query-split attention, which lets the output projection's Flash-RS (or Ulysses' all-to-all
back) compute attention one query piece per step. Per op, a causal piece is:

- CUDA flash: one call on keys [:e], ``is_causal=True``. For fewer queries than keys flash
  aligns the causal mask to the lower right (query row i sees keys up to i + S - L), which is
  exactly the offset diagonal.
- CPU flash, memory-efficient, cuDNN: their causal mask is aligned to the upper left, so two
  calls without a mask, merged by their logsumexps: the keys [0, s) every row sees, and the
  square block [s, e), causal as it stands (an explicit mask instead costs 2.6x the whole
  op's time on CPU: masked blocks are not skipped).

A mask or bias is cut with the queries (its rows [s, e)); only masks of type bool or of the
query's dtype are cut (cuDNN is reported to compute fp32 masks on bf16 inputs wrongly).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from .graph_utils import Emitter, aten, fake, same_size

CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH = aten._scaled_dot_product_flash_attention.default
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
CUDNN = aten._scaled_dot_product_cudnn_attention.default
ATTENTION = frozenset({CPU_FLASH, FLASH, EFFICIENT, CUDNN})
OUT, LOGSUMEXP = 0, 1  # every op's first two outputs; the rest are per call (RNG state, sizes)


def is_attention(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.target in ATTENTION


def arguments(target: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in."""
    named = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            named[arg.name] = args[i]
        elif arg.name in kwargs:
            named[arg.name] = kwargs[arg.name]
        else:
            named[arg.name] = arg.default_value if arg.has_default_value() else None
    return named


def call(emit: Emitter, target: torch._ops.OpOverload, named: dict[str, Any]) -> fx.Node:
    """Emit ``target`` with arguments by schema name (keyword-only ones as keywords)."""
    schema = target._schema.arguments
    args = tuple(named[a.name] for a in schema if not a.kwarg_only)
    return emit(target, *args, **{a.name: named[a.name] for a in schema if a.kwarg_only})


def mask_name(target: torch._ops.OpOverload) -> str | None:
    return {CPU_FLASH: "attn_mask", EFFICIENT: "attn_bias", CUDNN: "attn_bias"}.get(target)


def attention_axes(node: fx.Node, axis: int) -> dict[fx.Node, int | None] | None:
    """How to cut the inputs for output ``axis`` of an attention op: batch and heads cut q, k,
    v (and the mask where it is not broadcast) alike; the queries cut q (and the mask's rows)
    and read k, v whole. None where no cut is exact: dropout, a mask of another dtype than
    bool or the query's, a causal op with a mask, or q, k, v not three different tensors."""
    named = arguments(node.target, node.args, node.kwargs)
    q, k, v = named["query"], named["key"], named["value"]
    mask = named.get(mask_name(node.target) or "", None)
    if named["dropout_p"] or len({q, k, v}) < 3 or named["is_causal"] and mask is not None:
        return None
    if mask is not None and fake(mask).dtype not in (torch.bool, fake(q).dtype):
        return None
    mask_axis = {mask: _mask_axis(mask, axis)} if mask is not None else {}
    if any(m in (q, k, v) for m in mask_axis):
        return None
    if axis in (0, 1) and same_size(fake(q).shape[axis], fake(k).shape[axis]):
        return {q: axis, k: axis, v: axis, **mask_axis}
    if axis == 2 and same_size(fake(q).shape[2], fake(k).shape[2]):
        return {q: 2, k: None, v: None, **mask_axis}
    return None


def attention_refusal(node: fx.Node, axis: int) -> str:
    """Why :func:`attention_axes` cuts no input of ``node`` for output ``axis``."""
    named = arguments(node.target, node.args, node.kwargs)
    mask = named.get(mask_name(node.target) or "", None)
    if named["dropout_p"]:
        return "dropout"
    if named["is_causal"] and mask is not None:
        return "causal with a mask"
    if mask is not None and fake(mask).dtype not in (torch.bool, fake(named["query"]).dtype):
        return f"a {fake(mask).dtype} mask on {fake(named['query']).dtype} inputs: only bool or the query's dtype are cut"
    if axis == 2:
        return "as many keys as queries are needed to cut the queries"
    return f"no exact cut along dim {axis}"


def _mask_axis(mask: fx.Node, axis: int) -> int | None:
    """The mask's dim along output ``axis`` (it broadcasts from the right), None where it is
    broadcast there (size 1 or absent)."""
    dim = axis - (4 - fake(mask).dim())
    return dim if dim >= 0 and fake(mask).shape[dim] != 1 else None


@dataclasses.dataclass
class Merged:
    """A query piece computed by two calls merged: its out and logsumexp (in the op's own
    layout), and the diagonal call for the per-call outputs."""

    out: fx.Node
    logsumexp: fx.Node
    diagonal: fx.Node

    def output(self, emit: Emitter, index: int) -> fx.Node:
        if index == OUT:
            return self.out
        if index == LOGSUMEXP:
            return self.logsumexp
        return emit(operator.getitem, self.diagonal, index)


def query_split(emit: Emitter, node: fx.Node, args: tuple, kwargs: dict, q: int, count: int) -> fx.Node | Merged:
    """Attention of query rows [s, e) (``args`` hold piece q of the query and of the mask):
    the op itself on full attention and on the first piece; causal otherwise, one call on
    keys [:e] for flash, else the diagonal block merged with the keys before it."""
    target = node.target
    named = arguments(target, args, kwargs)
    if not named["is_causal"]:
        return emit(target, *args, **kwargs)
    length = fake(node.args[0]).shape[2] // count
    start, end = q * length, (q + 1) * length

    def attend(begin: int, stop: int, causal: bool) -> fx.Node:
        blocks = {name: emit(aten.slice.Tensor, named[name], 2, begin, stop) for name in ("key", "value")}
        call_named = {**named, **blocks, "is_causal": causal, "dropout_p": 0.0}
        if "compute_log_sumexp" in named:
            call_named["compute_log_sumexp"] = True  # (the merge needs it)
        return call(emit, target, call_named)

    if target is FLASH:
        return attend(0, end, True)
    diagonal = attend(start, end, True)
    if start == 0:
        return diagonal
    prefix = attend(0, start, False)
    rows = [(emit(operator.getitem, c, OUT), _lse_rows(emit, target, emit(operator.getitem, c, LOGSUMEXP), length)) for c in (prefix, diagonal)]
    out, lse = _merged(emit, *rows, fake(named["query"]).dtype)
    return Merged(out, _lse_as_op(emit, target, lse, length), diagonal)


def assembled_logsumexp(emit: Emitter, whole: fx.Node, pieces: list[fx.Node], axis: int) -> fx.Node:
    """The logsumexp output ``whole`` (a getitem of the op) from its query pieces' (``axis`` 2)
    or batch / head pieces'."""
    target, rows = whole.args[0].target, fake(whole.args[0].args[0]).shape[2]
    if target is EFFICIENT and fake(whole).shape[2] == 0:  # not computed (pieces may have: merged)
        return emit(aten.slice.Tensor, pieces[0], 2, 0, 0)
    if target is not EFFICIENT or axis != 2:
        return emit(aten.cat.default, pieces, axis)
    # memory-efficient attention pads its logsumexp to a multiple of 32 rows
    whole = emit(aten.cat.default, [_lse_rows(emit, target, p, rows // len(pieces)) for p in pieces], 2)
    return _lse_as_op(emit, target, whole, rows)


def _lse_rows(emit: Emitter, target: torch._ops.OpOverload, lse: fx.Node, rows: int) -> fx.Node:
    """A logsumexp in the op's layout as [B, H, rows]."""
    if target is EFFICIENT:
        return emit(aten.slice.Tensor, lse, 2, 0, rows)
    if target is CUDNN:  # [B, H, rows, 1]
        return emit(aten.squeeze.dim, lse, -1)
    return lse


def _lse_as_op(emit: Emitter, target: torch._ops.OpOverload, lse: fx.Node, rows: int) -> fx.Node:
    """[B, H, rows] in the op's own logsumexp layout."""
    if target is EFFICIENT:
        return emit(aten.constant_pad_nd.default, lse, [0, -rows % 32], 0.0)
    if target is CUDNN:
        return emit(aten.unsqueeze.default, lse, -1)
    return lse


def _merged(emit: Emitter, first: tuple[fx.Node, fx.Node], second: tuple[fx.Node, fx.Node], dtype: torch.dtype) -> tuple[fx.Node, fx.Node]:
    """Attention over two disjoint key sets from each one's (out, logsumexp): the softmax
    weights renormalised, lse = log(e^lse1 + e^lse2), out = Σ out_i·e^(lse_i − lse), in fp32."""
    (out1, lse1), (out2, lse2) = first, second
    top = emit(aten.maximum.default, lse1, lse2)  # (log-sum-exp from the larger: no overflow)
    spread = emit(aten.add.Tensor, *(emit(aten.exp.default, emit(aten.sub.Tensor, part, top)) for part in (lse1, lse2)))
    lse = emit(aten.add.Tensor, top, emit(aten.log.default, spread))

    def as_type(value: fx.Node, to: torch.dtype) -> fx.Node:
        return value if fake(value).dtype == to else emit(torch.ops.prims.convert_element_type.default, value, to)

    def weighted(out: fx.Node, part: fx.Node) -> fx.Node:
        weight = emit(aten.unsqueeze.default, emit(aten.exp.default, emit(aten.sub.Tensor, part, lse)), -1)
        return emit(aten.mul.Tensor, as_type(out, torch.float32), weight)

    out = emit(aten.add.Tensor, weighted(out1, lse1), weighted(out2, lse2))
    return as_type(out, dtype), lse
