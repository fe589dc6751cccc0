"""Stage 3b — outline (option ``outline``, off by default): each ring step's compute as one
call of a body compiled once per shape.

A ring's steps compute the same ops on different pieces. Emitted inline, each piece is a view
at its own offset into a larger buffer, and Inductor bakes the offset into the index
expressions of every kernel it generates (``in_ptr0 + 256L + ...``): N − 1 steps, N − 1 copies
of each kernel, each compiled again. Outlined, a step's compute is one
``invoke_subgraph(body, id, *inputs)``; Inductor lowers a body once, with its inputs as
separate tensors (the offsets live in the pointers passed at run time), and every step of that
shape — in this ring, in the other rings of the graph, in every layer — calls the same code.

Before (one step, inline)::

    piece = slice(x, 0, 128, 256);  h = silu(piece) * w3_piece;  y = mm(h, w2)
    start = ring_exchange(...);     ...;  wait(start)

After::

    body = get_attr("commfuse_step_body_0")                          # shared by same-shape steps
    out = invoke_subgraph(body, "commfuse_step_body_0", piece, w3_piece, w2, start)
    y = out[0];  ...;  wait(start)                                   # (wait pinned after y)

What goes in a body: the step's compute nodes and what they are computed from, among the nodes
this ring emitted, but for what two steps share (a weight's transpose, computed once) and the
cuts (slices) that carry a piece's offset, with what they cut from: the piece is an input.
Where Inductor would have to copy each such piece out of a view (a slice of a reshape of a
transpose), the whole source is copied once, contiguously, instead. The step's transfer is passed as
one more input the body does not read, so the body cannot run before the transfer starts (a
data dependency, where the inline form needs a control dependency). A body is outlined only
when at least two steps share its kernels; a body with a symbolic size, a non-tensor output
or an fp8 ``_scaled_mm`` (which checks its scales' strides on size-1 dims) is left inline.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx as fx

from .graph_utils import RESHAPES, SCALED_MM, WAIT, Emitter, aten, fake, ring_exchange_op
from .rowlocal import VIEWS as ROW_LOCAL_VIEWS
from .site import RingStep, Site

INVOKE = torch.ops.higher_order.invoke_subgraph
CUTS = {aten.slice.Tensor, aten.select.int}  # (a piece of a larger value, at an offset)
# Row-local views, and the cuts; getitem is not one here: it picks a value an op computed.
VIEWS = (ROW_LOCAL_VIEWS - {operator.getitem}) | CUTS | {aten.t.default}


class _Body:
    """One step's compute: its nodes (graph order), inputs, outputs and a shape signature.

    Outputs are the non-view nodes read outside; a view read outside (a reshape back to the
    tensor's layout) is made again outside, on the body's output it views."""

    def __init__(self, nodes: list[fx.Node], start: fx.Node | None):
        self.nodes = nodes
        inside = set(nodes)
        self.inputs: list[fx.Node] = []
        for node in nodes:
            for i in node.all_input_nodes:
                if i not in inside and i not in self.inputs:
                    self.inputs.append(i)
        self.start = start if start is not None and start not in self.inputs else None
        read_outside = [n for n in nodes if any(u not in inside for u in n.users)]
        self.views_outside = [n for n in read_outside if n.target in VIEWS]
        self.outputs = [n for n in read_outside if n.target not in VIEWS]
        for view in self.views_outside:
            base = _view_base(view, inside)
            if base is None:
                self.outputs = []  # (a view of an input read outside: nothing to outline it by)
                break
            if base not in self.outputs:
                self.outputs.append(base)
        self.signature = self._signature()

    def _signature(self) -> tuple | None:
        """Equal for two bodies exactly when one compiled body computes both (but for the
        start passed along, which nothing reads): its kernels are the same."""
        if not self.outputs:
            return None
        where = {n: ("input", i) for i, n in enumerate(self.inputs)} | {n: ("node", j) for j, n in enumerate(self.nodes)}
        layout = []
        for i in self.inputs:
            value = fake(i)
            if not isinstance(value, torch.Tensor) or not _static(value):
                return None
            layout.append((tuple(value.shape), value.stride(), value.dtype, value.device))
        ops = []
        for node in self.nodes:
            if node.target is SCALED_MM:  # (checks its scales' strides on size-1 dims, which an outlined input may not keep)
                return None
            value = fake(node)
            if not isinstance(value, torch.Tensor | tuple) or (isinstance(value, torch.Tensor) and not _static(value)):
                return None
            ops.append((node.target, _shape_of(node.args, where), _shape_of(node.kwargs, where)))
        if not all(isinstance(fake(out), torch.Tensor) for out in self.outputs):
            return None
        return tuple(layout), tuple(ops), tuple(where[o] for o in self.outputs)


def _view_base(view: fx.Node, inside: set[fx.Node]) -> fx.Node | None:
    """The non-view body node a chain of views inside the body starts from, if any."""
    node = view
    while node.target in VIEWS:
        node = node.args[0]
        if node not in inside:
            return None
    return node


def outline_steps(graph: fx.Graph, sites: list[Site]) -> int:
    """Outline every step whose body another step shares; returns the number of calls made."""
    owner = graph.owning_module
    if owner is None:
        return 0
    position = {node: i for i, node in enumerate(graph.nodes)}
    per_site = [(site, _step_nodes(site, position)) for site in sites]
    _copy_cut_sources(graph, [n for _, steps in per_site for _, nodes in steps for n in nodes])
    found = [(site, step, nodes, _Body(nodes, step.start).signature) for site, steps in per_site for step, nodes in steps]
    shared = Counter(signature for *_, signature in found if signature is not None)
    attrs: dict[tuple, fx.Node] = {}
    outlined: Counter[int] = Counter()  # by id(site)
    for site, step, nodes, signature in found:
        if signature is None or shared[signature] < 2:
            continue
        body = _Body(nodes, step.start)  # (again: an earlier call may have replaced an input)
        signature = (signature, body.start is not None)  # one compiled body each, same kernels
        if signature not in attrs:
            attrs[signature] = _register(graph, owner, body, len(attrs))
        _call(graph, attrs[signature], body, step)
        outlined[id(site)] += 1
    for site in sites:
        if outlined[id(site)]:
            site.notes.append(f"{outlined[id(site)]} of {len(site.steps)} steps outlined (a body compiled once per shape)")
    return sum(outlined.values())


def _step_nodes(site: Site, position: dict[fx.Node, int]) -> list[tuple[RingStep, list[fx.Node]]]:
    """Each step's body nodes: what its compute is computed from among the nodes the ring
    emitted, but for what two steps share (a weight's transpose: computed once, outside) and
    the slices that cut a step's pieces out of a larger tensor (their offsets differ from step
    to step: the body reads the piece as an input)."""
    emitted = set(site.emitted)
    exchange = ring_exchange_op()
    closures = []
    for step in site.steps:
        seen: set[fx.Node] = set()
        stack = [n for n in step.compute if n in emitted]
        while stack:
            node = stack.pop()
            if node in seen or node not in emitted or node.op != "call_function" or node.target in (exchange, WAIT, INVOKE):
                continue
            seen.add(node)
            stack += node.all_input_nodes
        closures.append(seen)
    shared = {node for node, count in Counter(n for c in closures for n in c).items() if count > 1}
    out = []
    for step, closure in zip(site.steps, closures):
        outside = shared | _cut_from(closure)
        nodes: list[fx.Node] = []
        for node in sorted(closure - outside, key=position.__getitem__):
            if node.target is operator.getitem and node.args[0] not in closure - outside:
                continue  # (an output of an op outside)
            nodes.append(node)
        if any(n.target not in VIEWS for n in nodes):
            out.append((step, nodes))
    return out


def _cut_from(closure: set[fx.Node]) -> set[fx.Node]:
    """The cuts in ``closure`` and what they cut from: the piece is the body's input."""
    found: set[fx.Node] = set()
    stack = [n for n in closure if n.target in CUTS]
    while stack:
        node = stack.pop()
        if node in closure and node not in found:
            found.add(node)
            stack += node.all_input_nodes
    return found


def _copy_cut_sources(graph: fx.Graph, body_nodes: list[fx.Node]) -> None:
    """Where a body's input is a cut of a view that Inductor must copy (a reshape of a
    transposed tensor), copy the whole source once, contiguously: cut from a plain buffer, the
    piece is a strided view, not one more copy kernel per offset."""
    inside = set(body_nodes)
    copies: dict[fx.Node, fx.Node] = {}
    cuts = {i for n in body_nodes for i in n.all_input_nodes if i not in inside and i.target in CUTS}
    for cut in sorted(cuts, key=lambda n: n.name):
        source = cut.args[0]
        if not _copied_by_inductor(source):
            continue
        if source not in copies:
            emit = Emitter(graph, before=source.next)
            copies[source] = emit(aten.clone.default, source, memory_format=torch.contiguous_format)
        emit = Emitter(graph, before=cut)
        cut.replace_all_uses_with(emit(cut.target, copies[source], *cut.args[1:], **cut.kwargs))


def _copied_by_inductor(node: fx.Node) -> bool:
    """Whether ``node`` is a chain of views one of which cannot be a strided view of its input
    (a reshape merging dims a permute separated)."""
    while node.target in VIEWS:
        if node.target in RESHAPES:
            source, shape = fake(node.args[0]), fake(node).shape
            try:
                source.view(shape)
            except (RuntimeError, ValueError):  # (fake tensors raise the latter)
                return True
        node = node.args[0]
    return False


def _register(graph: fx.Graph, owner: torch.nn.Module, body: _Body, index: int) -> fx.Node:
    """The body as a GraphModule attribute of the graph's owner, and one get_attr node for it."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(_operands(body)):
        env[node] = sub.placeholder(f"input_{i}")
        env[node].meta["val"] = fake(node)
    for node in body.nodes:
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[o] for o in body.outputs))
    name = f"commfuse_step_body_{index}"
    while hasattr(owner, name):
        name += "_"
    setattr(owner, name, fx.GraphModule(owner, sub))
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        attr = graph.get_attr(name)
    return attr


def _operands(body: _Body) -> list[fx.Node]:
    """The body's inputs, and the step's transfer last (read by nothing inside: it orders the
    body after the transfer's start)."""
    return [*body.inputs, body.start] if body.start is not None else body.inputs


def _call(graph: fx.Graph, attr: fx.Node, body: _Body, step: RingStep) -> None:
    """Replace the body's nodes by one call of the shared body and its outputs."""
    with graph.inserting_after(body.nodes[-1]):
        call = graph.call_function(INVOKE, (attr, attr.target, *_operands(body)))
    call.meta["val"] = tuple(fake(o) for o in body.outputs)
    made: dict[fx.Node, fx.Node] = {}
    with graph.inserting_after(call):
        for k, out in enumerate(body.outputs):
            made[out] = graph.call_function(operator.getitem, (call, k))
            made[out].meta["val"] = fake(out)
        for view in body.nodes:  # the views read outside, again on the outputs (graph order)
            if view not in made and (view in body.views_outside or any(view in _chain(v, made) for v in body.views_outside)):
                made[view] = graph.node_copy(view, lambda n: made[n])
    inside = set(body.nodes)
    for node, value in made.items():
        node.replace_all_uses_with(value, delete_user_cb=lambda user: user not in inside)
    for node in reversed(body.nodes):
        graph.erase_node(node)
    step.compute = [made[o] for o in body.outputs]
    step.outlined = call


def _chain(view: fx.Node, stop: dict[fx.Node, fx.Node]) -> list[fx.Node]:
    """The views between ``view`` and the first node in ``stop``."""
    chain = []
    while view not in stop:
        chain.append(view)
        view = view.args[0]
    return chain


def _static(value: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*value.shape, *value.stride()))


def _shape_of(args: Any, where: dict[fx.Node, tuple]) -> Any:
    """``args`` with nodes replaced by their place in the body (inputs and nodes by index),
    hashable (lists and dicts as tuples)."""
    if isinstance(args, fx.Node):
        return where[args]
    if isinstance(args, list | tuple):
        return tuple(_shape_of(a, where) for a in args)
    if isinstance(args, dict):
        return tuple((k, _shape_of(v, where)) for k, v in args.items())
    return args
