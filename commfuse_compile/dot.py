"""The rewritten region of a match as a DOT graph (networkx for the structure, DOT as text so
that no Graphviz binding is needed; ``dot -Tsvg`` renders it where Graphviz is installed)."""

from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx

from .report import SiteRecord

# fill colours per role: ring transfers, their waits, the step's matmuls, other emitted ops
COLORS = {"start": "#f4a261", "wait": "#8ecae6", "compute": "#90be6d", "op": "#e9ecef", "input": "#ffffff"}
CONTROL_DEPS = torch.ops.higher_order.control_deps


def region_graph(graph: fx.Graph, site: SiteRecord) -> nx.DiGraph:
    """The nodes the rewrite emitted for ``site`` and the inputs they read. Data edges are
    solid; the pinned order (``control_deps``: compute after start, wait after compute) is
    dashed."""
    inside = set(site.region)
    roles = {s.start: "start" for s in site.steps} | {s.wait: "wait" for s in site.steps}
    roles |= {name: "compute" for s in site.steps for name in s.compute}
    g = nx.DiGraph()
    for node in graph.nodes:
        if node.name not in inside:
            continue
        g.add_node(node.name, label=_label(node), role=roles.get(node.name, "op"))
        pinned = node.target is CONTROL_DEPS
        order = node.args[0] if pinned else ()
        data = node.args[2:] if pinned else node.args
        for parent in order:
            g.add_edge(parent.name, node.name, style="dashed")
        for parent in _nodes(data):
            if parent.name not in inside:
                g.add_node(parent.name, label=_label(parent), role="input")
            g.add_edge(parent.name, node.name, style="solid")
    return g


def region_dot(graph: fx.Graph, site: SiteRecord, title: str = "") -> str:
    """:func:`region_graph` as DOT text."""
    g = region_graph(graph, site)
    lines = [f'digraph "{_escape(title or site.collective)}" {{', "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    if title:
        lines.append(f'  label="{_escape(title)}"; labelloc=t;')
    for name, attrs in g.nodes(data=True):
        role = attrs.get("role", "input")
        shape = "ellipse" if role == "input" else "box"
        lines.append(f'  "{name}" [label="{_escape(attrs.get("label", name))}", shape={shape}, style=filled, fillcolor="{COLORS[role]}"];')
    for a, b, attrs in g.edges(data=True):
        lines.append(f'  "{a}" -> "{b}" [style={attrs["style"]}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _nodes(args) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, found.append)
    return found


def _label(node: fx.Node) -> str:
    target = node.target
    if target is CONTROL_DEPS:  # a pinned op: show the op it wraps
        target = _wrapped_op(node)
    elif node.op == "call_function":
        target = getattr(target, "__name__", str(target))
    else:
        target = node.op
    value = node.meta.get("val")
    shape = list(value.shape) if isinstance(value, torch.Tensor) else ""
    return f"{node.name}\n{target} {shape}".rstrip()


def _wrapped_op(node: fx.Node) -> str:
    subgraph = getattr(node.graph.owning_module, str(node.args[1].target), None)
    calls = [n for n in getattr(subgraph, "graph", fx.Graph()).nodes if n.op == "call_function"]
    return getattr(calls[0].target, "__name__", str(calls[0].target)) if calls else "pinned op"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
