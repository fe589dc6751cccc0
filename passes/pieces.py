"""Emitting a fusion region piece by piece, and putting what is read outside back together."""

from __future__ import annotations

import operator

import torch.fx as fx

from .attention import LOGSUMEXP, OUT, Merged, assembled_logsumexp, is_attention, query_split
from .graph_utils import RESHAPES, Emitter, aten, fake
from .regions import Region
from .rowlocal import input_axes


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
        return [self.values[n, q] for n in self.region.computed if self.region.outside_users(n)]

    def assemble(self, emit: Emitter) -> None:
        """Replace each region value read outside the region by its pieces, concatenated."""
        for node in self.region.computed:
            readers = self.region.outside_users(node)
            if readers and not is_attention(node):
                whole = self._whole(emit, node)
                node.replace_all_uses_with(whole, delete_user_cb=lambda user: user in readers)

    def _whole(self, emit: Emitter, node: fx.Node) -> fx.Node:
        parts = [self.value(emit, node, q) for q in range(self.region.count)]
        axis = self.region.axis[node]
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
        if is_attention(node) and along == 2:
            return query_split(emit, node, args, kwargs, q, self.region.count)
        if node.target is operator.getitem and isinstance(args[0], Merged):  # a merged query split's outputs
            return args[0].output(emit, args[1])
        return emit(node.target, *args, **kwargs)
