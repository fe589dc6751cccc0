"""Small helpers over post-grad FX graphs shared by the pipeline stages."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
WAIT = c10d.wait_tensor.default
MM = aten.mm.default
ADDMM = aten.addmm.default
MATMULS = {MM, ADDMM}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
# Views that reinterpret a row-major tensor without moving data (they appear around mm for
# leading dims: [B, S, H] -> [B*S, H] -> mm -> [B, S, M]).
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def ring_exchange_op() -> Any:
    """``torch.ops.commfuse.ring_exchange.default`` (registered on first use)."""
    import commfuse_compile.p2p  # noqa: F401

    return torch.ops.commfuse.ring_exchange.default


def fake(node: Any) -> Any:
    """The fake value of a node (or a constant passed as an argument)."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


def left_operand(matmul: fx.Node) -> fx.Node:
    """``A`` of ``mm(A, B)`` or ``addmm(bias, A, B)``."""
    return matmul.args[1] if matmul.target is ADDMM else matmul.args[0]


def right_operand(matmul: fx.Node) -> fx.Node:
    """``B`` of ``mm(A, B)`` or ``addmm(bias, A, B)``."""
    return matmul.args[2] if matmul.target is ADDMM else matmul.args[1]


def static_shape(node: fx.Node) -> list[int] | None:
    """The node's shape as ints, or None if any size is symbolic."""
    shape = fake(node).shape
    if all(isinstance(s, int) for s in shape):
        return list(shape)
    return None


def dataflow(graph: fx.Graph) -> nx.DiGraph:
    """The graph's data dependencies as a networkx DiGraph (edge: producer -> user)."""
    g = nx.DiGraph()
    g.add_nodes_from(graph.nodes)
    g.add_edges_from((node, user) for node in graph.nodes for user in node.users)
    return g


def describe_users(node: fx.Node) -> str:
    return ", ".join(f"{u.name} ({target_name(u)})" for u in node.users) or "none"


def target_name(node: fx.Node) -> str:
    if node.op == "output":
        return "graph output"
    target = node.target
    return getattr(target, "__name__", str(target)) if node.op == "call_function" else node.op


class Emitter:
    """Creates nodes, each with its ``meta["val"]``, before a given node."""

    def __init__(self, graph: fx.Graph, before: fx.Node):
        self.graph = graph
        self.before = before
        self.fake_mode = detect_fake_mode([n.meta["val"] for n in graph.nodes if "val" in n.meta])

    def __call__(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(target, args, kwargs)
        with self.fake_mode:
            node.meta["val"] = target(*fx.node.map_arg(args, fake), **fx.node.map_arg(kwargs, fake))
        return node


class GraphSnapshot:
    """A copy of a graph's body that can be put back in place.

    The pass mutates Inductor's graph object in place, so if it fails halfway the only safe
    fallback is to restore every node as it was (placeholders are kept: Inductor binds inputs
    to them).
    """

    def __init__(self, graph: fx.Graph):
        self.saved = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in graph.nodes:  # node_copy keeps names, meta and the output node
            env[node] = self.saved.node_copy(node, env.__getitem__)

    def restore(self, graph: fx.Graph) -> None:
        body = [n for n in graph.nodes if n.op != "placeholder"]
        for node in body:  # cut every edge first: a failed rewrite may leave nodes out of order
            node.args, node.kwargs = (), {}
        for node in [*graph.nodes]:  # (and edges from nodes no longer in the graph)
            node.users.clear() if node.op != "placeholder" else None
        for node in body:
            graph.erase_node(node)
        placeholders = iter([n for n in graph.nodes if n.op == "placeholder"])
        env: dict[fx.Node, fx.Node] = {}
        for node in self.saved.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            else:
                env[node] = graph.node_copy(node, env.__getitem__)


def erase_if_unused(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase nodes left without users (wait_tensor is side-effectful, so DCE keeps it)."""
    for node in nodes:
        if node is not None and not node.users:
            graph.erase_node(node)
