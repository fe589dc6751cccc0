"""Stage 3c — separate: every piece the rewrite cut is read through a pointer of its own.

A ring's steps compute the same ops on different pieces of a tensor. Emitted as ``aten.slice``,
each piece is a view at its own offset, and Inductor bakes the offset into every kernel that
reads it (``in_ptr0 + 256L + ...``): N − 1 copies of each kernel, each compiled again, more with
every rank added to the group or piece added to a chunk. Emitted as ``commfuse.piece``
(:mod:`commfuse_compile.piece`), the same view is made by one extern call per piece and handed
to the kernels as a tensor of its own: one compiled kernel per piece shape, called by every
step of every ring of that shape.

Before::

    p = slice(h, 1, 4, 8);  y = mul(p, 2)          # kernel: in_ptr0[x + 4·L + ...]

After::

    p = piece(h, 1, 4, 8);  y = mul(p, 2)          # kernel: in_ptr0[x + ...], p passed in

A piece of a pointwise op's result, where nothing else reads that result, is computed from
pieces of the op's inputs instead: cut as a ``piece``, the result would have to be written
whole to memory first (Inductor computes an op into the kernel that reads it, but cannot
see through the extern call), where the slice let each step's kernel compute its own part.
A ReLU's mask in backward is the common case (8× slower written as a bool tensor here)::

    m = le(r, 0);  piece(m, 0, 0, 416), piece(m, 0, 416, 832)
    →  le(piece(r, 0, 0, 416), 0), le(piece(r, 0, 416, 832), 0)

A piece that must be copied before a matmul reads it (rows of ``[B, S, H]`` cut along ``S``,
flattened to ``[B·L, H]``) is copied by ``commfuse.contiguous`` (ATen's clone): the same bytes
moved, and no copy kernel to compile per piece layout::

    reshape(p, [-1, H])   →   reshape(contiguous(p), [-1, H])
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from commfuse_compile.piece import CONTIGUOUS, PIECE

from .graph_utils import RESHAPES, aten, fake, ring_exchange_op, same_shape, same_size
from .rowlocal import VIEWS
from .site import Site


def separate_pieces(graph: fx.Graph, sites: list[Site]) -> int:
    """Turn the slices the sites' rewrites emitted into pieces; returns how many pieces."""
    replaced: dict[fx.Node, fx.Node] = {}  # each slice or piece -> the node that took its place
    owner: dict[fx.Node, Site] = {}
    made: dict[tuple, fx.Node] = {}  # (site, tensor, dim, start, end) -> a piece made here
    for site in sites:
        for node in site.emitted:
            if node._erased or node.target is not aten.slice.Tensor or _step_of(node) != 1:
                continue
            piece = _piece(graph, made, (id(site), *node.args[:4]), node, meta=node.meta)  # (one for a slice emitted twice)
            node.replace_all_uses_with(piece)
            graph.erase_node(node)
            replaced[node], owner[piece] = piece, site
    _compute_pointwise_on_pieces(graph, list(owner), replaced, owner, made)
    pieces = [node for node in owner if not node._erased and node.target is PIECE]
    for piece in pieces:
        if not _contiguous_if_sent(graph, piece):
            _copy_before_reshapes(graph, piece)
    for site in sites:
        _follow(site, replaced, [node for node, mine in owner.items() if mine is site and not node._erased])
    return len(pieces)


def _follow(site: Site, replaced: dict[fx.Node, fx.Node], mine: list[fx.Node]) -> None:
    """Point the site's records at the nodes that took the place of its slices."""

    def final(node: fx.Node) -> fx.Node:
        while node in replaced:
            node = replaced[node]
        return node

    renamed = {node.name: final(node).name for node in replaced}
    emitted = [final(node) for node in site.emitted if not final(node)._erased]
    site.emitted = emitted + [node for node in mine if node not in set(emitted)]
    site.region = [renamed.get(name, name) for name in site.region] + [node.name for node in site.emitted[len(emitted):]]
    for step in site.steps:
        step.compute = [final(node) for node in step.compute]


def _compute_pointwise_on_pieces(
    graph: fx.Graph, pieces: list[fx.Node], replaced: dict[fx.Node, fx.Node], owner: dict[fx.Node, Site], made: dict[tuple, fx.Node]
) -> None:
    """Where every reader of a pointwise op's result is a piece, compute the op on pieces of
    its inputs instead, until no such op is left (the nodes added are ``owner``'s too)."""
    work = list(pieces)
    while work:
        piece = work.pop()
        if piece._erased:
            continue
        whole = piece.args[0]
        if not all(user.target is PIECE for user in whole.users):
            continue
        # (each reader's own cut: two pieces of one tensor may be cut along different dims)
        cuts_of = {user: _pointwise_cuts(whole, user.args[1]) for user in whole.users}
        if any(cuts is None for cuts in cuts_of.values()):
            continue
        done: dict[tuple, fx.Node] = {}  # (site, cut) -> the op computed on that piece
        for user, cuts in sorted(cuts_of.items()):
            _, _, start, end = user.args
            site = owner.get(user)
            if (same := done.get((id(site), *user.args[1:]))) is not None:  # an equal piece read before
                user.replace_all_uses_with(same)
                graph.erase_node(user)
                replaced[user] = same
                continue
            with graph.inserting_before(user):
                args = [_piece(graph, made, (id(site), arg, dim, start, end), user) if dim is not None else arg for arg, dim in zip(whole.args, cuts)]
                computed = graph.call_function(whole.target, tuple(args), dict(whole.kwargs))
            computed.meta["val"] = whole.target(*fx.node.map_arg(tuple(args), fake), **whole.kwargs)
            user.replace_all_uses_with(computed)
            graph.erase_node(user)
            replaced[user] = done[id(site), *user.args[1:]] = computed
            new_pieces = [a for a in args if isinstance(a, fx.Node) and a.target is PIECE and a not in whole.args]
            for node in (*new_pieces, computed):
                owner[node] = site
            work.extend(new_pieces)
        graph.erase_node(whole)


def part_of_cat(tensor: fx.Node, dim: int, start: Any, end: Any) -> fx.Node | None:
    """The input of a ``cat`` that the piece ``(tensor, dim, start, end)`` is exactly, where
    ``tensor`` is that cat's result through views that undo each other; else None.

    Another ring's steps put their results together with a cat: a piece of it that is one
    step's result can be read from that step alone (:mod:`.order` does, where reading all of
    it would keep two rings waiting for each other)::

        y = cat([y0, y1], 1);  piece(reshape(reshape(y, [64, 384]), [2, 32, 384]), 1, 16, 32)   →   y1
    """
    base = _through_undone_views(tensor)
    if base is None or base.target is not aten.cat.default:
        return None
    parts, cat_dim = base.args[0], base.args[1] if len(base.args) > 1 else 0
    rank = fake(base).dim()
    if (cat_dim % rank) != (dim % rank):
        return None
    offset = 0
    for part in parts:
        size = fake(part).shape[cat_dim]
        if same_size(offset, start) and same_size(offset + size, end):  # (a cat's parts agree on every other dim)
            return part
        offset = offset + size
    return None


def _through_undone_views(tensor: fx.Node) -> fx.Node | None:
    """The nearest node above ``tensor`` from which the reshapes and permutes between them
    undo each other (``tensor`` holds its values in its shape), if any other than ``tensor``."""
    chain: list[fx.Node] = []
    node = tensor
    while node.target in RESHAPES or node.target is aten.permute.default:
        chain.append(node)
        node = node.args[0]
        if _undone(list(reversed(chain))):
            return node
    return None


def _undone(views: list[fx.Node]) -> bool:
    """Whether applying ``views`` in turn (each reads the one before) gives back the first one's
    input: consecutive reshapes merge and a reshape to its input's shape does nothing;
    consecutive permutes compose and the identity does nothing."""
    # Each view as (kind, shape before, shape after, permutation).
    ops = [
        ("permute", (), (), tuple(d % fake(v).dim() for d in v.args[1])) if v.target is aten.permute.default else ("reshape", tuple(fake(v.args[0]).shape), tuple(fake(v).shape), None)
        for v in views
    ]
    merged: list[tuple] = []
    for op in ops:
        if merged and merged[-1][0] == op[0]:
            kind, shape_in, _, first = merged.pop()
            op = (kind, shape_in, op[2], tuple(first[i] for i in op[3]) if kind == "permute" else None)
        identity = op[3] == tuple(range(len(op[3]))) if op[0] == "permute" else same_shape(op[1], op[2])
        if not identity:
            merged.append(op)
    return not merged


def _piece(graph: fx.Graph, made: dict[tuple, fx.Node], key: tuple, before: fx.Node, meta: dict | None = None) -> fx.Node:
    """Piece ``key = (site, tensor, dim, start, end)`` for a node at ``before``: the one made
    for the same site already where there is one (a slice emitted twice, two ops cut on pieces
    reading the same input's), else a new one placed before it (with ``meta`` where given: the
    slice's it replaces)."""
    if (earlier := made.get(key)) is not None and not earlier._erased:
        _place_before(earlier, before)
        return earlier
    _, tensor, dim, start, end = key
    with graph.inserting_before(before):
        node = made[key] = graph.call_function(PIECE, (tensor, dim, start, end))
    if meta is not None:
        node.meta = meta
    else:
        node.meta["val"] = PIECE(fake(tensor), dim, start, end)
    return node


def _place_before(piece: fx.Node, reader: fx.Node) -> None:
    """Move ``piece`` up to just before ``reader`` if it comes later: its tensor is read there
    already (a piece of it replaces a slice there, or an op computed on it is put there), so
    the move keeps the graph sorted."""
    if reader < piece:
        reader.prepend(piece)


def _pointwise_cuts(node: fx.Node, dim: int) -> list[int | None] | None:
    """For a pointwise op cut along ``dim``: the dim to cut each argument along (None: passed
    whole, a scalar or broadcast along it), or None if the op is not one we can cut so."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or torch.Tag.pointwise not in target.tags:
        return None
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()) or not isinstance(fake(node), torch.Tensor):
        return None
    out = fake(node).shape
    cuts: list[int | None] = []
    for arg in node.args:
        if not isinstance(arg, fx.Node):
            cuts.append(None)
            continue
        value = fake(arg)
        if not isinstance(value, torch.Tensor):
            return None
        own = dim - (len(out) - value.dim())  # dims align from the right when broadcasting
        if own < 0 or value.shape[own] == 1:
            cuts.append(None)
        elif value.shape[own] == out[dim]:
            cuts.append(own)
        else:
            return None
    return cuts


def _contiguous_if_sent(graph: fx.Graph, piece: fx.Node) -> bool:
    """A strided piece that a ring exchange sends (a rank's own piece, cut from its shard along
    a dim other than the first) is made contiguous for every reader: the transfer needs it so,
    and the step computing on it then reads the layout of the pieces it receives, with the same
    kernels. Returns whether it did."""
    if fake(piece).is_contiguous() or not any(u.target is ring_exchange_op() for u in piece.users):
        return False
    with graph.inserting_after(piece):
        copy = graph.call_function(CONTIGUOUS, (piece,))
    copy.meta["val"] = CONTIGUOUS(fake(piece))
    piece.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)
    return True


def _copy_before_reshapes(graph: fx.Graph, piece: fx.Node) -> None:
    """Where a view of ``piece`` is reshaped to a shape no view of it has (Inductor would copy
    it in a kernel of its own), copy it with ``commfuse.contiguous`` first."""
    stack = [piece]
    while stack:
        node = stack.pop()
        for user in list(node.users):
            if user.target in RESHAPES and user.args[0] is node and not _viewable(node, user):
                with graph.inserting_before(user):
                    copy = graph.call_function(CONTIGUOUS, (node,))
                copy.meta["val"] = CONTIGUOUS(fake(node))
                user.replace_input_with(node, copy)
            elif user.target in VIEWS and user.target is not operator.getitem:
                stack.append(user)


def _viewable(source: fx.Node, reshape: fx.Node) -> bool:
    """Whether ``reshape`` can be a view of ``source`` (asked of a meta tensor of its layout
    where the sizes are ints: a fake tensor takes milliseconds to answer)."""
    value, shape = fake(source), fake(reshape).shape
    if all(isinstance(s, int) for s in (*value.shape, *value.stride(), *shape)):
        value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    try:
        value.view(shape)
    except (RuntimeError, ValueError):  # (fake tensors raise the latter)
        return False
    return True


def _step_of(node: fx.Node) -> int:
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
