"""The layout ops frontends put between a collective and its matmuls, followed in both directions.

``funcol.all_gather_tensor(x, gather_dim=d)``, DTensor sequence parallelism and
``reduce_scatter_tensor(y, scatter_dim=d)`` move the gathered / scattered dim with a split along
one dim and a cat along another; matmuls read the tensor through reshapes (leading dims
flattened) and transposes. These helpers recognise those forms; nothing is mutated here.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch.fx as fx

from .graph_utils import RESHAPES, SPLITS, WAIT, aten, fake


def single_wait(node: fx.Node) -> fx.Node | None:
    """The ``wait_tensor`` that is a collective's only reader, if so."""
    users = list(node.users)
    if len(users) == 1 and users[0].target is WAIT:
        return users[0]
    return None


def split_cat(tensor: fx.Node, pieces: int, split_dim: int) -> tuple[fx.Node, int] | None:
    """If ``tensor`` is only read by ``pieces`` equal pieces along ``split_dim`` (a split and its
    getitems, or slices) that one ``cat`` concatenates in order: that cat and its dim."""
    ndim = fake(tensor).dim()
    size = fake(tensor).shape[split_dim] // pieces
    users = list(tensor.users)
    if len(users) == 1 and users[0].target in SPLITS and dim_arg(users[0], 2) % ndim == split_dim:
        parts = sorted(users[0].users, key=lambda g: g.args[1] if g.target is operator.getitem else -1)
        if [g.args[1] if g.target is operator.getitem else None for g in parts] != list(range(pieces)):
            return None
    elif len(users) == pieces and all(u.target is aten.slice.Tensor for u in users):
        parts = sorted(users, key=lambda u: u.args[2])
        expected = [(split_dim, q * size, (q + 1) * size) for q in range(pieces)]
        if [(dim_arg(u, 1) % ndim, *u.args[2:4]) for u in parts] != expected:
            return None
    else:
        return None
    cats = {user for part in parts for user in part.users}
    if len(cats) != 1 or any(len(part.users) != 1 for part in parts):
        return None
    (cat,) = cats
    if cat.target is not aten.cat.default or list(cat.args[0]) != parts:
        return None
    return cat, dim_arg(cat, 1) % fake(cat).dim()


def split_cat_source(cat: fx.Node) -> tuple[fx.Node, int] | None:
    """The tensor and dim that ``cat``'s first piece was split / sliced from, if any."""
    if cat.target is not aten.cat.default or not cat.args[0]:
        return None
    piece = cat.args[0][0]
    if piece.target is operator.getitem and piece.args[0].target in SPLITS:
        split = piece.args[0]
        return split.args[0], dim_arg(split, 2) % fake(split.args[0]).dim()
    if piece.target is aten.slice.Tensor:
        return piece.args[0], dim_arg(piece, 1) % fake(piece.args[0]).dim()
    return None


def dim_arg(node: fx.Node, position: int) -> int:
    return node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)


def reshape_chains(node: fx.Node, views: tuple[fx.Node, ...] = ()) -> Iterator[tuple[fx.Node, tuple[fx.Node, ...]]]:
    """``node`` and every reshape reached from it (with batch 1, DTensor's sequence gather is
    ``all_gather → view [1, S, H] → view [S, H]``), with the reshapes on the way."""
    yield node, views
    for user in node.users:
        if user.target in RESHAPES:
            yield from reshape_chains(user, (*views, user))


def transpose_chains(node: fx.Node, permutes: tuple[fx.Node, ...] = ()) -> Iterator[tuple[fx.Node, tuple[fx.Node, ...]]]:
    """``node`` and every 2-D transpose reached from it, with the transposes on the way."""
    yield node, permutes
    for user in node.users:
        if user.target is aten.permute.default and list(user.args[1]) == [1, 0]:
            yield from transpose_chains(user, (*permutes, user))
