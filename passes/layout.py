"""The layout ops frontends put between a collective and its matmuls, followed in both directions.

``funcol.all_gather_tensor(x, gather_dim=d)``, DTensor sequence parallelism and
``reduce_scatter_tensor(y, scatter_dim=d)`` move the gathered / scattered dim with a split along
one dim and a cat along another; torchtitan's ``spmd_types`` moves it with
``movedim(d, 0).contiguous()`` before the collective and ``movedim(0, d)`` after (permute and
clone in the aten graph); matmuls read the tensor through reshapes (leading dims flattened),
copies and transposes. These helpers recognise those forms and say where the dim went; nothing
is mutated here.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
import torch.fx as fx

from .graph_utils import DTYPE_VIEW, RESHAPES, SPLITS, WAIT, aten, fake, hinted, same_size

PERMUTE = aten.permute.default
SYM_SIZE = aten.sym_size.int


def is_copy(node: fx.Node) -> bool:
    """A ``clone`` that keeps the values and dims (``.contiguous()``, ``.clone()``)."""
    fmt = node.kwargs.get("memory_format", torch.contiguous_format)
    return node.target is aten.clone.default and fmt in (torch.contiguous_format, torch.preserve_format) and set(node.kwargs) <= {"memory_format"}


def compose(first: tuple[int, ...], then: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation of ``x.permute(first).permute(then)``."""
    return tuple(first[i] for i in then)


def after_permutes(node: fx.Node, dim: int) -> tuple[fx.Node, int, tuple[int, ...], list[fx.Node]]:
    """From a gathered ``node`` whose gathered dim is ``dim``, the copies and permutes that are
    its only readers, one after another (``movedim(0, d)`` after an all-gather): the last of
    them, where the gathered dim is now, the permutation they apply, and the nodes passed.
    A permute that would make the gathered dim the last one is not passed: a matmul reads such
    a transpose (``x @ AG(W).t()``, FSDP's weight gather) as its own operand's columns."""
    perm, passed = tuple(range(fake(node).dim())), []
    while len(node.users) == 1:
        (user,) = node.users
        if user.target is PERMUTE:
            order = tuple(d % len(perm) for d in user.args[1])
            if order.index(dim) == len(order) - 1:
                break
            perm, dim = compose(perm, order), order.index(dim)
        elif not is_copy(user):
            break
        node = user
        passed.append(node)
    return node, dim, perm, passed


def before_permutes(node: fx.Node) -> tuple[fx.Node, int, tuple[int, ...], list[fx.Node]]:
    """Into a scattered ``node`` (scattered on dim 0), the copies and permutes that produce it,
    each read only by the next (``movedim(d, 0).contiguous()`` before a reduce-scatter): the
    tensor before them, its dim that lands on dim 0, the permutation from it to ``node``, and
    the nodes passed (including ``node`` if it is one of them)."""
    orders, passed = [], []
    while (node.target is PERMUTE or is_copy(node)) and len(node.users) == 1:
        if node.target is PERMUTE:
            orders.append(tuple(d % fake(node).dim() for d in node.args[1]))
        passed.append(node)
        node = node.args[0]
    perm = tuple(range(fake(node).dim()))
    for order in reversed(orders):
        perm = compose(perm, order)
    return node, perm[0], perm, passed


def single_wait(node: fx.Node, also_output: bool = False) -> fx.Node | None:
    """The ``wait_tensor`` that is a collective's only reader, if so; with ``also_output``, the
    graph output may read the collective too (selective activation checkpointing saves it
    for backward, which waits on it again)."""
    waits = [u for u in node.users if u.target is WAIT]
    others = [u for u in node.users if u.target is not WAIT and u.target is not SYM_SIZE]  # (sizes: see rewrite)
    if len(waits) == 1 and all(also_output and u.op == "output" for u in others):
        return waits[0]
    return None


def split_cat(tensor: fx.Node, pieces: int, split_dim: int) -> tuple[fx.Node, int] | None:
    """If ``tensor`` is only read by ``pieces`` equal pieces along ``split_dim`` (a split and its
    getitems, or slices) that one ``cat`` concatenates in order: that cat and its dim. Each
    piece may be viewed as another dtype of the same element size on the way, all alike (fp8
    gathered as uint8: PyTorch's async-TP form views each chunk back before the cat); the cat
    then has that dtype."""
    ndim = fake(tensor).dim()
    size = fake(tensor).shape[split_dim] // pieces
    users = list(tensor.users)
    if len(users) == 1 and users[0].target in SPLITS and dim_arg(users[0], 2) % ndim == split_dim:
        parts = sorted(users[0].users, key=lambda g: g.args[1] if g.target is operator.getitem else -1)
        if [g.args[1] if g.target is operator.getitem else None for g in parts] != list(range(pieces)):
            return None
    elif len(users) == pieces and all(u.target is aten.slice.Tensor for u in users):
        # (bounds may be symbolic: s0-row pieces of a [N·s0, ...] gather are sliced at SymInt nodes)
        parts = sorted(users, key=lambda u: hinted(fake(u.args[2])))
        for q, part in enumerate(parts):
            start, end = (fake(b) for b in part.args[2:4])
            if dim_arg(part, 1) % ndim != split_dim or not (same_size(start, q * size) and same_size(end, (q + 1) * size)):
                return None
    else:
        return None
    parts = [_through_dtype_views(part) for part in parts]
    if len({fake(part).dtype for part in parts}) != 1:
        return None
    cats = {user for part in parts for user in part.users}
    if len(cats) != 1 or any(len(part.users) != 1 for part in parts):
        return None
    (cat,) = cats
    if cat.target is not aten.cat.default or list(cat.args[0]) != parts:
        return None
    return cat, dim_arg(cat, 1) % fake(cat).dim()


def _through_dtype_views(node: fx.Node) -> fx.Node:
    """``node``, or the last of the same-size dtype views that are its only reader in turn."""
    while len(node.users) == 1 and is_same_size_dtype_view(user := next(iter(node.users))):
        node = user
    return node


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
    """``node`` and every reshape (or copy, or same-size dtype view) reached from it (with batch
    1, DTensor's sequence gather is ``all_gather → view [1, S, H] → view [S, H]``), with the
    reshapes on the way."""
    yield node, views
    for user in node.users:
        if user.target in RESHAPES or is_copy(user) or is_same_size_dtype_view(user):
            yield from reshape_chains(user, (*views, user))


def is_same_size_dtype_view(node: fx.Node) -> bool:
    """``x.view(dtype)`` to a dtype of the same element size (fp8 gathered as uint8 and viewed
    back): the same shape, the same bytes."""
    return node.target is DTYPE_VIEW and fake(node).element_size() == fake(node.args[0]).element_size()


def transpose_chains(node: fx.Node, permutes: tuple[fx.Node, ...] = ()) -> Iterator[tuple[fx.Node, tuple[fx.Node, ...]]]:
    """``node`` and every 2-D transpose reached from it, with the transposes on the way."""
    yield node, permutes
    for user in node.users:
        if user.target is aten.permute.default and list(user.args[1]) == [1, 0]:
            yield from transpose_chains(user, (*permutes, user))
