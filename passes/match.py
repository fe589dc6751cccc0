"""Stage 1 — match: find every all-gather and reduce-scatter and the matmuls around them.

Recognised forms (post-grad aten graph, functional collectives; ``[ ]`` is optional)::

    Flash-AG:  all_gather_into_tensor(x, N, group) -> wait_tensor
                   [-> split(dim 0) -> getitem × N -> cat(dim d)]      gather on dim d != 0
                   (or N slices of dim 0 instead of split + getitem)
                   -> [reshape] -> mm(·, W) / addmm(b, ·, W)           one or more consumers
    Flash-RS:  sum of mm / addmm terms, joined by add and reshape
                   [-> split(dim d) -> getitem × N -> cat(dim 0)]      scatter on dim d != 0
                   -> reduce_scatter_tensor(·, "sum", N, group) -> wait_tensor

The split/cat forms are what ``funcol.all_gather_tensor(x, gather_dim=d)``, DTensor sequence
parallelism and ``reduce_scatter_tensor(y, scatter_dim=d)`` produce. Every collective yields a
Site: a recognised one is "pending" for the plan stage, any other is already "skip" with the
reason. Nothing is mutated here.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import networkx as nx
import torch.fx as fx

from .graph_utils import (
    ADDMM,
    ALL_GATHER,
    COALESCED,
    MATMULS,
    REDUCE_SCATTER,
    RESHAPES,
    SPLITS,
    WAIT,
    aten,
    dataflow,
    describe_users,
    fake,
    left_operand,
    right_operand,
    static_shape,
    target_name,
)
from .site import SYMBOLIC_SIZES, Consumer, Site


def find_sites(graph: fx.Graph, graph_kind: str) -> list[Site]:
    """All collective sites of ``graph`` in graph order."""
    flow = dataflow(graph)
    sites: list[Site] = []
    for node in graph.nodes:
        if node.target is ALL_GATHER:
            sites.append(_match_all_gather(node, graph_kind, flow))
        elif node.target is REDUCE_SCATTER:
            sites.append(_match_reduce_scatter(node, graph_kind))
        elif node.target in COALESCED:
            sites.append(_coalesced(node, graph_kind))
    return sites


def _single_wait(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    if len(users) == 1 and users[0].target is WAIT:
        return users[0]
    return None


def _split_cat(tensor: fx.Node, pieces: int, split_dim: int) -> tuple[fx.Node, int] | None:
    """If ``tensor`` is only read by ``pieces`` equal pieces along ``split_dim`` (a split and its
    getitems, or slices) that one ``cat`` concatenates in order: that cat and its dim."""
    ndim = fake(tensor).dim()
    size = fake(tensor).shape[split_dim] // pieces
    users = list(tensor.users)
    if len(users) == 1 and users[0].target in SPLITS and _dim_arg(users[0], 2) % ndim == split_dim:
        parts = sorted(users[0].users, key=lambda g: g.args[1] if g.target is operator.getitem else -1)
        if [g.args[1] if g.target is operator.getitem else None for g in parts] != list(range(pieces)):
            return None
    elif len(users) == pieces and all(u.target is aten.slice.Tensor for u in users):
        parts = sorted(users, key=lambda u: u.args[2])
        expected = [(split_dim, q * size, (q + 1) * size) for q in range(pieces)]
        if [(_dim_arg(u, 1) % ndim, *u.args[2:4]) for u in parts] != expected:
            return None
    else:
        return None
    cats = {user for part in parts for user in part.users}
    if len(cats) != 1 or any(len(part.users) != 1 for part in parts):
        return None
    (cat,) = cats
    if cat.target is not aten.cat.default or list(cat.args[0]) != parts:
        return None
    return cat, _dim_arg(cat, 1) % fake(cat).dim()


def _split_cat_source(cat: fx.Node) -> tuple[fx.Node, int] | None:
    """The tensor and dim that ``cat``'s first piece was split / sliced from, if any."""
    if cat.target is not aten.cat.default or not cat.args[0]:
        return None
    piece = cat.args[0][0]
    if piece.target is operator.getitem and piece.args[0].target in SPLITS:
        split = piece.args[0]
        return split.args[0], _dim_arg(split, 2) % fake(split.args[0]).dim()
    if piece.target is aten.slice.Tensor:
        return piece.args[0], _dim_arg(piece, 1) % fake(piece.args[0]).dim()
    return None


def _dim_arg(node: fx.Node, position: int) -> int:
    return node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)


def _matmul_consumers(gathered: fx.Node) -> Iterator[Consumer]:
    """Matmuls reading the gathered tensor through a chain of reshapes and a chain of
    ``permute(·, [1, 0])``, with the role the gathered dim plays in each."""
    for view, views in _reshape_chains(gathered, ()):
        for operand, permutes in _transpose_chains(view, ()):
            transposed = len(permutes) % 2 == 1
            for mm in operand.users:
                if mm.target not in MATMULS:
                    continue
                left, right = left_operand(mm) is operand, right_operand(mm) is operand
                if left == right:  # not an operand, or both (x @ x.t()): leave it
                    continue
                if left:
                    role = "contraction" if transposed else "rows"
                else:
                    role = "columns" if transposed else "contraction"
                yield Consumer(mm=mm, views=views, role=role, permutes=permutes)


def _reshape_chains(node: fx.Node, views: tuple[fx.Node, ...]) -> Iterator[tuple[fx.Node, tuple[fx.Node, ...]]]:
    """``node`` and every reshape reached from it (with batch 1, DTensor's sequence gather is
    ``all_gather → view [1, S, H] → view [S, H]``), with the reshapes on the way."""
    yield node, views
    for user in node.users:
        if user.target in RESHAPES:
            yield from _reshape_chains(user, (*views, user))


def _transpose_chains(node: fx.Node, permutes: tuple[fx.Node, ...]) -> Iterator[tuple[fx.Node, tuple[fx.Node, ...]]]:
    """``node`` and every 2-D transpose reached from it, with the transposes on the way."""
    yield node, permutes
    for user in node.users:
        if user.target is aten.permute.default and list(user.args[1]) == [1, 0]:
            yield from _transpose_chains(user, (*permutes, user))


def _match_all_gather(ag: fx.Node, graph_kind: str, flow: nx.DiGraph) -> Site:
    shard, group_size, group_name = ag.args[:3]
    site = Site("all_gather→mm", graph_kind, ag, _single_wait(ag), group_name, group_size)
    site.shapes["shard"] = list(fake(shard).shape)
    if static_shape(shard) is None:  # (checked first: symbolic sizes add sym_size readers)
        return site.skip(SYMBOLIC_SIZES)
    if site.wait is None:
        return site.skip(f"all-gather is not read through a single wait_tensor (users: {describe_users(ag)})")
    site.tensor, site.dim = _split_cat(site.wait, group_size, 0) or (site.wait, 0)
    if site.dim:
        site.shapes["gathered"] = list(fake(site.tensor).shape)
    consumers = list(_matmul_consumers(site.tensor))
    if not consumers:
        if any(u.target is ADDMM and u.args[0] is site.tensor for u in site.tensor.users):
            return site.skip("the gathered tensor is only added as an addmm bias: no matmul to overlap with")
        return site.skip(f"no matmul reads the gathered tensor (users: {describe_users(site.tensor)})")
    downstream = nx.descendants(flow, site.wait)
    for consumer in consumers:
        if consumer.other_operand(site.tensor) in downstream:
            site.notes.append(f"{consumer.mm.name}: its other operand depends on the gathered tensor; left as is")
        else:
            site.consumers.append(consumer)
    if not site.consumers:
        return site.skip("the other operand of every consuming matmul depends on the gathered tensor")
    for i, consumer in enumerate(site.consumers):
        site.shapes[f"{consumer.role}{i}"] = list(fake(consumer.other_operand(site.tensor)).shape)
    return site


def _matmul_terms(node: fx.Node, path: list[fx.Node]) -> list[Consumer] | None:
    """The matmuls whose sum (through reshapes and same-shape adds) is ``node``, or None.

    Inductor folds ``a + b @ c`` into ``addmm(a, b, c)``: an addmm whose bias is a full
    [R, M] tensor is one more term (role "product": its own product, without the bias) plus
    the terms of its bias. ``path`` collects every node between the matmuls and ``node`` (to
    check they have no other users: if the full product is read elsewhere, computing it per
    chunk saves nothing).
    """
    path.append(node)
    if node.target is ADDMM and not node.kwargs and fake(node.args[0]).shape == fake(node).shape:
        bias_terms = _matmul_terms(node.args[0], path)
        return None if bias_terms is None else [*bias_terms, Consumer(mm=node, role="product")]
    if node.target in MATMULS:
        return [Consumer(mm=node)]
    if node.target in RESHAPES:
        return _matmul_terms(node.args[0], path)
    if node.target is aten.add.Tensor and not node.kwargs and len(node.args) == 2:
        a, b = node.args
        if not all(isinstance(t, fx.Node) and fake(t).shape == fake(node).shape for t in (a, b)):
            return None  # broadcasting add: not a sum of same-shape products
        left, right = _matmul_terms(a, path), _matmul_terms(b, path)
        return left + right if left is not None and right is not None else None
    return None


def _match_reduce_scatter(rs: fx.Node, graph_kind: str) -> Site:
    scattered, reduce_op, group_size, group_name = rs.args[:4]
    site = Site("mm→reduce_scatter", graph_kind, rs, _single_wait(rs), group_name, group_size)
    site.shapes["input"] = list(fake(scattered).shape)
    if static_shape(scattered) is None:
        return site.skip(SYMBOLIC_SIZES)
    if site.wait is None:
        return site.skip(f"reduce-scatter is not read through a single wait_tensor (users: {describe_users(rs)})")
    if reduce_op != "sum":
        return site.skip(f"reduce op {reduce_op!r}: only 'sum' is decomposed")
    site.tensor, site.dim = scattered, 0
    source = _split_cat_source(scattered)
    if source is not None and _split_cat(source[0], group_size, source[1]) == (scattered, 0):
        site.tensor, site.dim = source
        site.shapes["scattered"] = list(fake(site.tensor).shape)
    path: list[fx.Node] = []
    terms = _matmul_terms(site.tensor, path)
    if terms is None:
        producer = target_name(next(n for n in path if n.target not in RESHAPES))
        return site.skip(
            f"reduce-scatter input is produced by {producer}, not a matmul or a sum of matmuls: not yet supported"
        )
    for node in path:
        # (the split/cat form's input is read by its N pieces, checked by _split_cat)
        if len(node.users) > 1 and not (node is site.tensor and site.tensor is not scattered):
            return site.skip(
                f"{node.name} has other users ({describe_users(node)}): the full product is "
                "needed anyway; not yet supported"
            )
    site.consumers = terms
    for i, term in enumerate(terms):
        site.shapes[f"lhs{i}"] = list(fake(left_operand(term.mm)).shape)
        site.shapes[f"rhs{i}"] = list(fake(right_operand(term.mm)).shape)
    return site


def _coalesced(node: fx.Node, graph_kind: str) -> Site:
    group_size, group_name = node.args[-2:]  # both coalesced ops end with (group_size, group_name)
    site = Site(COALESCED[node.target], graph_kind, node, None, group_name, group_size)
    return site.skip("coalesced collective (several tensors in one call): not yet supported")
