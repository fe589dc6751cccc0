"""Row-local ops: which ops compute piece q of their output from piece q of their inputs.

A ring step computes one piece q of the gathered / scattered dim. :func:`input_axes` says, for
an op cut into ``count`` pieces along one axis of its output, along which axis each input must
be cut (or that it is read whole, where it broadcasts) — or that the op mixes pieces. Row-local
here: pointwise ops (torch's ``pointwise`` tag) with broadcasting, reshapes that keep a piece a
block, permutes, squeeze, unsqueeze, expand, reductions over other dims, ``mm`` / ``addmm`` by rows (the
right operand read whole: a replicated weight) or by columns (the left read whole, the right
cut: one head group's projection), and attention (:mod:`.attention`) and its backward by query
rows (:mod:`.attention_backward`: dQ is cut, dK and dV are summed over the pieces).
"""

from __future__ import annotations

import dataclasses
import operator
from math import prod
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .attention import ATTENTION, attention_axes, is_attention
from .attention_backward import ATTENTION_BACKWARD, DQ, backward_axes, is_attention_backward
from .graph_utils import ADDMM, MM, RESHAPES, aten, divides, fake, same_size

REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}

# The "axis" of a matmul contracting over the cut (its left operand cut by columns, its right
# by rows): each piece is a partial product, the whole is their sum.
PARTIAL_SUM = -1

SQUEEZES = {aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims}
VIEWS = {*RESHAPES, *SQUEEZES, aten.permute.default, aten.unsqueeze.default, aten.expand.default, operator.getitem}

@dataclasses.dataclass(frozen=True)
class Blocks:
    """Pieces whose sizes are known only at run time (an all-to-all's split sizes, read from a
    tensor with ``.tolist()``): ``sizes``, the nodes computing them (or ints), along an axis of
    size ``total``, their sum. Every axis cut into them has that size; a piece is a
    ``split_with_sizes`` block and a reshape of one keeps its cut dim as -1."""

    sizes: tuple[fx.Node | int, ...]
    total: Any  # (a SymInt: the sum of the sizes)

    @property
    def count(self) -> int:
        return len(self.sizes)


def cuttable(size: Any, count: int, blocks: Blocks | None = None) -> bool:
    """Whether an axis of ``size`` can be cut into the pieces: ``count`` equal ones at a size
    baked into the code (a static size), or ``blocks`` (its size is theirs)."""
    if blocks is not None:
        return same_size(size, blocks.total)
    return isinstance(size, int) and size % count == 0


def input_axes(node: fx.Node, axis: int, count: int, blocks: Blocks | None = None) -> dict[fx.Node, int | None] | None:
    """For ``node`` cut into ``count`` pieces along ``axis`` (equal ones, or ``blocks``): the
    axis each tensor input is cut along (None: read whole), or None if piece q of the output is
    not computable from piece q of its inputs."""
    axes = _input_axes(node, axis, count, blocks)
    if axes is None:
        return None
    # Pieces are cut at sizes baked into the code (or at the blocks' sizes): every cut axis
    # must have a static size (or the blocks' total).
    if any(along is not None and isinstance(fake(i), torch.Tensor) and not _cut_size_ok(fake(i).shape[along], blocks) for i, along in axes.items()):
        return None
    for i in node.all_input_nodes:  # symbolic sizes passed along (a reshape's sizes): read whole
        if isinstance(fake(i), torch.SymInt):
            axes.setdefault(i, None)
    return axes


def _cut_size_ok(size: Any, blocks: Blocks | None) -> bool:
    return same_size(size, blocks.total) if blocks is not None else isinstance(size, int)


def _input_axes(node: fx.Node, axis: int, count: int, blocks: Blocks | None) -> dict[fx.Node, int | None] | None:
    if axis == PARTIAL_SUM:
        return _contraction_axes(node, count) if blocks is None else None
    if node.target is operator.getitem and is_attention(node.args[0]):  # (also its per-call outputs)
        return None if blocks is not None else {node.args[0]: axis}
    if node.target is operator.getitem and is_attention_backward(node.args[0]):  # dK, dV: summed, not cut
        return {node.args[0]: axis} if blocks is None and node.args[1] == DQ else None
    out = fake(node)
    if isinstance(out, torch.Tensor) and (axis >= out.dim() or not cuttable(out.shape[axis], count, blocks)):
        return None
    inputs = [i for i in node.all_input_nodes if not isinstance(fake(i), torch.SymInt)]
    if node.target not in RESHAPES and len(inputs) < len(node.all_input_nodes):
        return None  # a symbolic size read as a value
    if not all(isinstance(fake(i), (torch.Tensor, tuple)) for i in inputs):
        return None
    target = node.target
    if target in RESHAPES:
        other = list(fake(inputs[0]).shape)
        return _single(inputs[0], reshape_axis(list(out.shape), axis, other, count) if blocks is None else _same_axis(list(out.shape), axis, other))
    if target is aten.permute.default:
        return _single(inputs[0], list(node.args[1])[axis] % out.dim())
    if target is aten.unsqueeze.default:
        inserted = node.args[1] % out.dim()
        return None if axis == inserted else _single(inputs[0], axis - (axis > inserted))
    if target in SQUEEZES:
        return _single(inputs[0], _squeezed_input_axis(node, axis))
    if target is aten.expand.default:  # (its size 1 dims broadcast: read whole along them)
        return _broadcast_axes(out.shape, inputs, axis)
    if target in REDUCTIONS:
        return _single(inputs[0], _reduced_input_axis(node, axis))
    if target in (MM, ADDMM):
        return _matmul_axes(node, axis)
    if target in ATTENTION:
        return attention_axes(node, axis) if blocks is None else None  # (query splits: equal pieces only)
    if target in ATTENTION_BACKWARD:
        return backward_axes(node, axis) if blocks is None else None
    if isinstance(target, torch._ops.OpOverload) and is_pointwise(target) and isinstance(out, torch.Tensor):
        return _broadcast_axes(out.shape, inputs, axis)
    return None

def _single(node: fx.Node, axis: int | None) -> dict[fx.Node, int | None] | None:
    return None if axis is None else {node: axis}

def is_pointwise(target: torch._ops.OpOverload) -> bool:
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
    for j, size in enumerate(other):  # (sizes may be symbolic: asked without guards)
        if same_size(prod(other[:j]), leading) and statically_known_true(size > 1):
            trailing = prod(other[j + 1 :])
            return j if divides(trailing, run) and divides(count, size) else None
        if not statically_known_true(prod(other[:j]) <= leading):
            break
    return None

def _same_axis(shape: list[Any], axis: int, other: list[Any]) -> int | None:
    """The axis of ``other`` (a reshape of ``shape``) that is ``shape``'s ``axis`` unchanged:
    the same elements before it and the same size (pieces of unknown size stay pieces only so)."""
    leading = prod(shape[:axis])
    for j, size in enumerate(other):
        if same_size(prod(other[:j]), leading) and same_size(size, shape[axis]):
            return j
    return None

def _squeezed_input_axis(node: fx.Node, axis: int) -> int:
    """The input axis that output ``axis`` of a squeeze is (the size-1 dims it drops are gone)."""
    shape = fake(node.args[0]).shape
    named = node.args[1] if len(node.args) > 1 else range(len(shape))
    named = {d % len(shape) for d in ([named] if isinstance(named, int) else named)}
    kept = [d for d in range(len(shape)) if not (d in named and same_size(shape[d], 1))]
    return kept[axis]

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
    """Rows of ``mm(A, B)`` are rows of A, B read whole; columns are columns of B, A read
    whole (the projection of one head group). An addmm's bias is cut like the output, or read
    whole where it broadcasts."""
    bias, a, b = node.args if node.target is ADDMM else (None, *node.args)
    if a is b or bias in (a, b):
        return None
    axes = {a: 0, b: None} if axis == 0 else {a: None, b: 1}
    if isinstance(bias, fx.Node):
        bias_shape, size = fake(bias).shape, fake(node).shape[axis]
        along = axis - (2 - len(bias_shape))  # (a 1-D bias is a row: only its columns are cut)
        cut = along >= 0 and same_size(bias_shape[along], size) and statically_known_true(size > 1)
        axes[bias] = along if cut else None
    return axes


def _contraction_axes(node: fx.Node, count: int) -> dict[fx.Node, int | None] | None:
    """``mm(A, B)`` (or ``addmm``, its bias added once to the sum) as partial products: A cut
    by columns, B by rows (the cut runs along the contracted dim)."""
    if node.target not in (MM, ADDMM) or node.kwargs:  # (an addmm's beta / alpha: not here)
        return None
    bias, a, b = node.args if node.target is ADDMM else (None, *node.args)
    if a is b or bias in (a, b) or not cuttable(fake(a).shape[1], count):
        return None
    return {a: 1, b: 0, **({bias: None} if isinstance(bias, fx.Node) else {})}


def _broadcast_axes(shape: torch.Size, inputs: list[fx.Node], axis: int) -> dict[fx.Node, int | None] | None:
    axes: dict[fx.Node, int | None] = {}
    for i in inputs:
        ishape = fake(i).shape
        aligned = axis - (len(shape) - len(ishape))
        if aligned < 0 or same_size(ishape[aligned], 1):
            axes[i] = None
        elif same_size(ishape[aligned], shape[axis]):
            axes[i] = aligned
        else:
            return None
    return axes

def axes_of(node: fx.Node) -> range:
    value = fake(node)
    return range(value.dim()) if isinstance(value, torch.Tensor) else range(3)  # attention's tuple
