"""Stage 1 — match: find every all-gather and reduce-scatter and the matmuls around them.

Recognised forms (post-grad aten graph, functional collectives):

    all_gather_into_tensor(x, N, group) -> wait_tensor -> [view] -> mm(·, W)      (Flash-AG)
    mm(A, B) -> [view] -> reduce_scatter_tensor(·, op, N, group) -> wait_tensor   (Flash-RS)

Every collective yields a Site. A Site whose form is not recognised is already marked "skip"
with the reason; the others are "pending" for the plan stage. Nothing is mutated here.
"""

from __future__ import annotations

from collections.abc import Iterator

import networkx as nx
import torch.fx as fx

from .graph_utils import (
    ALL_GATHER,
    COALESCED,
    MM,
    REDUCE_SCATTER,
    RESHAPES,
    WAIT,
    dataflow,
    describe_users,
    static_shape,
    target_name,
)
from .site import Consumer, Site


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


def _left_operand_mms(wait: fx.Node) -> Iterator[Consumer]:
    """Matmuls reading the gathered tensor, directly or through one reshape, as left operand."""
    for user in wait.users:
        if user.target is MM and user.args[0] is wait:
            yield Consumer(mm=user)
        elif user.target in RESHAPES:
            for mm in user.users:
                if mm.target is MM and mm.args[0] is user:
                    yield Consumer(mm=mm, view=user)


def _why_no_consumer(wait: fx.Node) -> str:
    users = list(wait.users)
    targets = {target_name(u) for u in users}
    if "split.Tensor" in targets or "split_with_sizes.default" in targets or "chunk.default" in targets:
        return (
            "gathered tensor is split and re-concatenated (gather dim != 0, e.g. a sequence-"
            "parallel layout): not yet supported"
        )
    for user in users:
        readers = [user, *user.users] if user.target in RESHAPES else [user]
        if any(r.target is MM and r.args[1] in (wait, user) for r in readers):
            return (
                "gathered tensor feeds aten.mm only as its right operand (weight gather or "
                "gather along the contraction dim): not yet supported"
            )
    return f"no aten.mm reads the gathered tensor as its left operand (users: {describe_users(wait)})"


def _match_all_gather(ag: fx.Node, graph_kind: str, flow: nx.DiGraph) -> Site:
    shard, group_size, group_name = ag.args[:3]
    site = Site("all_gather→mm", graph_kind, ag, _single_wait(ag), group_name, group_size)
    site.shapes["shard"] = static_shape(shard) or list(shard.meta["val"].shape)
    if site.wait is None:
        return site.skip(f"all-gather is not read through a single wait_tensor (users: {describe_users(ag)})")
    consumers = list(_left_operand_mms(site.wait))
    if not consumers:
        return site.skip(_why_no_consumer(site.wait))
    downstream = nx.descendants(flow, site.wait)
    for consumer in consumers:
        weight = consumer.mm.args[1]
        if weight in downstream or weight is site.wait:
            site.notes.append(
                f"{consumer.mm.name}: right operand depends on the gathered tensor; left as is"
            )
        else:
            site.consumers.append(consumer)
    if not site.consumers:
        return site.skip("right operand of every consuming mm depends on the gathered tensor")
    for i, consumer in enumerate(site.consumers):
        site.shapes[f"weight{i}"] = list(consumer.mm.args[1].meta["val"].shape)
    return site


def _match_reduce_scatter(rs: fx.Node, graph_kind: str) -> Site:
    product, reduce_op, group_size, group_name = rs.args[:4]
    site = Site("mm→reduce_scatter", graph_kind, rs, _single_wait(rs), group_name, group_size)
    site.shapes["input"] = list(product.meta["val"].shape)
    if site.wait is None:
        return site.skip(f"reduce-scatter is not read through a single wait_tensor (users: {describe_users(rs)})")
    if reduce_op != "sum":
        return site.skip(f"reduce op {reduce_op!r}: only 'sum' is decomposed")
    view = None
    mm = product
    if product.target in RESHAPES:
        view, mm = product, product.args[0]
    if not isinstance(mm, fx.Node) or mm.target is not MM:
        producer = target_name(mm) if isinstance(mm, fx.Node) else repr(mm)
        return site.skip(f"reduce-scatter input is produced by {producer}, not aten.mm: not yet supported")
    for node in (view, mm):
        if node is not None and len(node.users) > 1:
            return site.skip(
                f"{node.name} has other users ({describe_users(node)}): the full product is "
                "needed anyway; not yet supported"
            )
    site.consumers.append(Consumer(mm=mm, view=view))
    site.shapes["lhs"] = list(mm.args[0].meta["val"].shape)
    site.shapes["rhs"] = list(mm.args[1].meta["val"].shape)
    return site


def _coalesced(node: fx.Node, graph_kind: str) -> Site:
    group_size, group_name = node.args[-2:]  # both coalesced ops end with (group_size, group_name)
    site = Site(COALESCED[node.target], graph_kind, node, None, group_name, group_size)
    return site.skip("coalesced collective (several tensors in one call): not yet supported")
