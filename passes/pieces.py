"""Emitting a fusion region piece by piece, and putting what is read outside back together."""

from __future__ import annotations

import operator

import torch.fx as fx

from .attention import LOGSUMEXP, OUT, Merged, assembled_logsumexp, is_attention, query_split
from .attention_backward import BlockGradients, assembled_gradient, is_attention_backward, query_block_backward
from .graph_utils import ADDMM, MM, RESHAPES, Emitter, aten, fake, same_size, sum_in_fp32
from .regions import Region
from .rowlocal import PARTIAL_SUM, Blocks, input_axes


def cut(emit: Emitter, node: fx.Node, axis: int, q: int, count: int, blocks: Blocks | None = None) -> fx.Node:
    """Piece q of ``node`` along ``axis``: a slice of one of ``count`` equal pieces, or block q
    of ``blocks`` (one ``split_with_sizes`` by the run-time sizes, shared by every block)."""
    if blocks is None:
        size = fake(node).shape[axis] // count
        return emit(aten.slice.Tensor, node, axis, q * size, (q + 1) * size)
    if (part := _block_of_cat(node, axis, q, blocks)) is not None:
        return part
    return emit(operator.getitem, emit(aten.split_with_sizes.default, node, list(blocks.sizes), axis), q)


def _block_of_cat(node: fx.Node, axis: int, q: int, blocks: Blocks) -> fx.Node | None:
    """Block q of a ``cat`` of exactly those blocks (an MoE dispatch's expert outputs, put
    together, sent back by the combine): the part itself, not a view of the copy."""
    if node.target is not aten.cat.default or (node.args[1] if len(node.args) > 1 else 0) % fake(node).dim() != axis:
        return None
    parts = node.args[0]
    if len(parts) != blocks.count or not all(same_size(fake(p).shape[axis], fake(s)) for p, s in zip(parts, blocks.sizes)):
        return None
    return parts[q]


class Pieces:
    """Emits a region's nodes on piece q (memoised), and puts read-outside values back together."""

    def __init__(self, region: Region):
        self.region = region
        self.values: dict[tuple[fx.Node, int], fx.Node] = {}
        self.slices: dict[tuple[fx.Node, int, int], fx.Node] = {}

    def give(self, node: fx.Node, q: int, value: fx.Node) -> None:
        self.values[node, q] = value

    def value(self, emit: Emitter, node: fx.Node, q: int) -> fx.Node | Merged:
        if (node, q) not in self.values:
            self.values[node, q] = self._emit(emit, node, q)
        return self.values[node, q]

    def compute(self, emit: Emitter, q: int) -> list[fx.Node]:
        """Every region node on piece q; returns the pieces read outside the region."""
        for node in self.region.computed:
            self.value(emit, node, q)
        read_outside = [self.values[n, q] for n in self.region.computed if self.region.outside_users(n)]
        return [node for value in read_outside for node in (value.nodes() if isinstance(value, BlockGradients) else [value])]

    def assemble(self, emit: Emitter) -> None:
        """Replace each region value read outside the region by its pieces, concatenated (an
        attention backward's dK and dV: summed)."""
        for node in self.region.computed:
            readers = self.region.outside_users(node)
            if is_attention_backward(node):  # read through getitems: dK, dV summed over the pieces
                blocks = [self.value(emit, node, q) for q in range(self.region.count)]
                for reader in readers:
                    reader.replace_all_uses_with(assembled_gradient(emit, blocks, reader.args[1]))
            elif readers and not is_attention(node):
                whole = self._whole(emit, node)
                node.replace_all_uses_with(whole, delete_user_cb=lambda user: user in readers)

    def _whole(self, emit: Emitter, node: fx.Node) -> fx.Node:
        parts = [self.value(emit, node, q) for q in range(self.region.count)]
        axis = self.region.axis[node]
        if axis == PARTIAL_SUM:  # partial products: their sum (an addmm's bias once)
            bias = [node.args[0]] if node.target is ADDMM else []
            return sum_in_fp32(emit, [*parts, *bias], fake(node).dtype)
        if node.target is operator.getitem and is_attention(node.args[0]):
            if node.args[1] == LOGSUMEXP:
                return assembled_logsumexp(emit, node, parts, axis)
            if node.args[1] != OUT:  # per call (RNG state, sizes): no dropout here, any piece's will do
                return parts[0]
        return emit(aten.cat.default, parts, axis)

    def piece(self, emit: Emitter, node: fx.Node, axis: int, q: int) -> fx.Node:
        """Piece q of ``node``: computed if it is in the region, else sliced along ``axis``."""
        return self.value(emit, node, q) if node in self.region.axis else self.slice(emit, node, axis, q)

    def slice(self, emit: Emitter, node: fx.Node, axis: int, q: int) -> fx.Node:
        if (node, axis, q) not in self.slices:
            self.slices[node, axis, q] = cut(emit, node, axis, q, self.region.count, self.region.blocks)
        return self.slices[node, axis, q]

    def _emit(self, emit: Emitter, node: fx.Node, q: int) -> fx.Node:
        along = self.region.axis[node]
        axes = input_axes(node, along, self.region.count, self.region.blocks)

        def piece_of(arg: fx.Node) -> fx.Node:
            return arg if axes[arg] is None else self.piece(emit, arg, axes[arg], q)

        args, kwargs = fx.node.map_arg((node.args, node.kwargs), piece_of)
        if along == PARTIAL_SUM:  # this piece's product (an addmm's bias is added to the sum)
            return emit(MM, *args[-2:])
        if node.target in RESHAPES or node.target is aten.expand.default:  # to the piece's shape
            shape = list(fake(node).shape)
            # (a block of run-time size: the reshape's one -1)
            shape[along] = shape[along] // self.region.count if self.region.blocks is None else -1
            # (a piece may be a non-contiguous slice: reshape, not view)
            return emit(aten.expand.default if node.target is aten.expand.default else aten.reshape.default, args[0], shape)
        if is_attention(node) and along == 2:
            return query_split(emit, node, args, kwargs, q, self.region.count)
        if is_attention_backward(node):
            return query_block_backward(emit, node, args, kwargs, q, self.region.count)
        if node.target is operator.getitem and isinstance(args[0], Merged):  # a merged query split's outputs
            return args[0].output(emit, args[1])
        if node.target is operator.getitem and isinstance(args[0], BlockGradients):
            return args[0].output(args[1])
        return emit(node.target, *args, **kwargs)
