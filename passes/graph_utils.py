"""Small helpers over post-grad FX graphs shared by the pipeline stages."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true

from commfuse_compile.piece import CONTIGUOUS, PIECE

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
WAIT = c10d.wait_tensor.default
MM = aten.mm.default
ADDMM = aten.addmm.default
# ``_scaled_mm(A, B, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)``: an fp8
# matmul, A's scale a scalar (tensorwise) or one per row ([M, 1], rowwise).
SCALED_MM = aten._scaled_mm.default
MATMULS = {MM, ADDMM, SCALED_MM}
# A reinterpretation of the bytes as another dtype of the same size (fp8 is gathered as uint8).
DTYPE_VIEW = aten.view.dtype
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
# Views that reinterpret a row-major tensor without moving data (they appear around mm for
# leading dims: [B, S, H] -> [B*S, H] -> mm -> [B, S, M]).
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# Ops whose result is a function of their arguments alone (views, and ATen's contiguous copy):
# an Emitter emits each (op, arguments) once and hands the same node to every later reader.
# The rings ask for the same rows again (each matmul of a step reshapes the step's chunk,
# each term of a sum cuts the same piece): one node each is fewer nodes for Inductor to lower,
# schedule and call.
REUSABLE = RESHAPES | {aten.permute.default, aten.slice.Tensor, aten.expand.default, aten.unsqueeze.default, PIECE, CONTIGUOUS, aten.split_with_sizes.default, operator.getitem}


def ring_exchange_op() -> Any:
    """``torch.ops.commfuse.ring_exchange.default`` (registered on first use)."""
    import commfuse_compile.p2p  # noqa: F401

    return torch.ops.commfuse.ring_exchange.default


def fake(node: Any) -> Any:
    """The fake value of a node (or a constant passed as an argument)."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


def left_operand(matmul: fx.Node) -> fx.Node:
    """``A`` of ``mm(A, B)``, ``addmm(bias, A, B)`` or ``_scaled_mm(A, B, ...)``."""
    return matmul.args[1] if matmul.target is ADDMM else matmul.args[0]


def right_operand(matmul: fx.Node) -> fx.Node:
    """``B`` of ``mm(A, B)``, ``addmm(bias, A, B)`` or ``_scaled_mm(A, B, ...)``."""
    return matmul.args[2] if matmul.target is ADDMM else matmul.args[1]


# Sizes may be symbolic (``torch.compile``'s automatic dynamic shapes make a batch dim a
# SymInt after the second batch size). Every question about them is asked so that it holds for
# every value of the symbols and adds no guard: the graph was guarded before this pass ran, so
# a guard added now would never be checked, and a rank-dependent hint must not steer a plan.


def same_size(a: Any, b: Any) -> bool:
    """``a == b`` for every value of the symbols (ints or SymInts)."""
    return statically_known_true(a == b)


def same_shape(a: Any, b: Any) -> bool:
    """Two shapes (lists of ints / SymInts) equal for every value of the symbols."""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def divides(n: Any, size: Any) -> bool:
    """``size % n == 0`` for every value of the symbols."""
    return statically_known_true(size % n == 0)


def hinted(size: Any) -> int:
    """An int for a size: itself, or the example value a symbolic size was compiled with (for
    the cost model only; every rank of a group compiles the same shapes, which the first-call
    plan check verifies)."""
    return size if isinstance(size, int) else optimization_hint(size)


def hinted_shape(node: fx.Node) -> list[int]:
    return [hinted(s) for s in fake(node).shape]


def shape_of(node: fx.Node) -> list[int | str]:
    """The node's shape for a record: ints, and symbolic sizes by their expression (``s0``)."""
    return [s if isinstance(s, int) else str(s) for s in fake(node).shape]


def bytes_of(value: torch.Tensor) -> int:
    """The tensor's size in bytes (at the hint of a symbolic size)."""
    return hinted(value.numel()) * value.element_size()


class SymbolicArgument(NotImplementedError):
    """An emitted node would carry a symbolic size as a constant: the pass refuses the graph
    (the caller restores it) rather than bake one example value into the code."""


def describe_users(node: fx.Node) -> str:
    return ", ".join(f"{u.name} ({target_name(u)})" for u in node.users) or "none"


def target_name(node: fx.Node) -> str:
    if node.op == "output":
        return "graph output"
    target = node.target
    return getattr(target, "__name__", str(target)) if node.op == "call_function" else node.op


class Emitter:
    """Creates nodes, each with its ``meta["val"]``, before a given node.

    The graph stays topologically sorted: an input that comes after the insertion point (a
    weight's transpose placed before the second consumer, say) is moved up in front of the new
    node, its own late inputs first. So later stages can walk the graph in order without
    sorting it again after every rewrite.
    """

    def __init__(self, graph: fx.Graph, before: fx.Node):
        self.graph = graph
        self.before = before
        self.fake_mode = detect_fake_mode([_first_fake_tensor(graph)])
        self.emitted: dict[tuple, fx.Node] = {}  # (op, arguments) -> node, for REUSABLE ops

    def __call__(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> fx.Node:
        if target in RESHAPES and any(not isinstance(s, int) for s in args[1]):
            args = (args[0], self._reshape_sizes(args[0], args[1]), *args[2:])
        if any(isinstance(a, torch.SymInt) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
            raise SymbolicArgument(f"{target}: a symbolic size among the arguments {args}")
        key = (target, frozen(args), frozen(kwargs)) if target in REUSABLE else None
        # (every node of this Emitter sits before the same anchor, so an earlier one is in
        # place for any later reader; one erased since, by dead-code elimination, is made again)
        if key is not None and (earlier := self.emitted.get(key)) is not None and not earlier._erased:
            return earlier
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(target, args, kwargs)
        _hoist_inputs(node)
        with self.fake_mode:
            node.meta["val"] = target(*fx.node.map_arg(args, fake), **fx.node.map_arg(kwargs, fake))
        for recorded in _RECORDERS.get(self.graph, ()):
            recorded.append(node)
        if key is not None:
            self.emitted[key] = node
        return node

    def _reshape_sizes(self, tensor: fx.Node, sizes: list[Any]) -> list[int]:
        """The sizes of a reshape with its one symbolic size as -1 (a SymInt cannot be an
        argument: its value differs from call to call)."""
        with self.fake_mode:
            shape = fake(tensor).reshape(list(sizes)).shape
        symbolic = [d for d, s in enumerate(shape) if not isinstance(s, int)]
        if len(symbolic) > 1:
            raise SymbolicArgument(f"reshape of {tensor.name} to {list(shape)}: more than one symbolic size")
        return [-1 if not isinstance(s, int) else s for s in shape]


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
        _free_names(graph, [n.name for n in self.saved.nodes if n.op != "placeholder"])
        placeholders = iter([n for n in graph.nodes if n.op == "placeholder"])
        env: dict[fx.Node, fx.Node] = {}
        for node in self.saved.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            else:
                env[node] = graph.node_copy(node, env.__getitem__)


def _free_names(graph: fx.Graph, names: list[str]) -> None:
    """Let the nodes put back take their old names again (FX keeps an erased node's name
    taken): the records and logs then name the nodes the user's graph has. A torch whose
    namespace differs only gets other names."""
    used = getattr(getattr(graph, "_graph_namespace", None), "_used_names", None)
    if isinstance(used, set):
        used.difference_update(names)


def frozen(value: Any) -> Any:
    """``value`` with its lists as tuples and its dicts as sorted item tuples (a dict key)."""
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, frozen(v)) for k, v in value.items()))
    return value


def _first_fake_tensor(graph: fx.Graph) -> torch.Tensor | None:
    """Some tensor value of the graph (they all share one fake mode): an input's, found
    without walking the graph, else the first node's that has one."""
    for nodes in (graph.find_nodes(op="placeholder"), graph.nodes):
        if (value := next((n.meta["val"] for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)), None)) is not None:
            return value
    return None


def _hoist_inputs(node: fx.Node, anchor: fx.Node | None = None) -> None:
    """Move every input of ``node`` that comes after ``anchor`` (default: ``node`` itself) to
    just before ``anchor``, their own late inputs first."""
    anchor = anchor or node
    for late in node.all_input_nodes:
        if anchor < late:  # (checked now: hoisting an earlier input may have moved this one)
            _hoist_inputs(late, anchor)
            anchor.prepend(late)


def depends_on(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``node`` reads ``source``, directly or through other nodes. In a sorted graph only
    the nodes between the two can lie on such a path, so only those are visited."""
    seen, stack = {node}, [node]
    while stack:
        for i in stack.pop().all_input_nodes:
            if i is source:
                return True
            if i not in seen and source < i:
                seen.add(i)
                stack.append(i)
    return False


# Lists that every Emitter of a graph appends its new nodes to, while ``recording`` it.
_RECORDERS: dict[fx.Graph, list[list[fx.Node]]] = {}


@contextlib.contextmanager
def recording(graph: fx.Graph) -> Iterator[list[fx.Node]]:
    """Collect the nodes emitted into ``graph`` inside the block (those still in it at the end,
    in graph order): what one rewrite added, without comparing the whole graph before and after.

    On leaving, the graph is sorted again where the block replaced a value by a new node
    placed after some of its readers (an assembled piece read by the old value's readers):
    those readers, and what reads them in turn, move to just after it.
    """
    created: list[fx.Node] = []
    _RECORDERS.setdefault(graph, []).append(created)
    kept: list[fx.Node] = []
    try:
        yield kept
    finally:
        _RECORDERS[graph].remove(created)
        if not _RECORDERS[graph]:
            del _RECORDERS[graph]
        kept += sorted(n for n in created if not n._erased)
    for node in kept:
        _sink_readers(node)


def _sink_readers(node: fx.Node) -> None:
    """Move the nodes placed before ``node`` that read it (directly or not) to just after it,
    keeping their order."""
    early, stack = set(), [u for u in node.users if u < node]
    while stack:
        reader = stack.pop()
        if reader not in early:
            early.add(reader)
            stack += [u for u in reader.users if u < node]
    cursor = node
    for reader in sorted(early):
        cursor.append(reader)
        cursor = reader


def collapse_wait_chains(graph: fx.Graph) -> int:
    """``wait_tensor(wait_tensor(c))`` → ``wait_tensor(c)``: the second wait does nothing (the
    collective is complete) and would hide the first one's real readers from a match. Funcol's
    autograd all-to-all and an all-to-all read with ``.tolist()`` leave such chains. Returns how
    many waits went."""
    chained = [n for n in graph.find_nodes(op="call_function", target=WAIT) if isinstance(n.args[0], fx.Node) and n.args[0].target is WAIT]
    for wait in chained:
        wait.replace_all_uses_with(wait.args[0])
        graph.erase_node(wait)
    return len(chained)


def erase_dead(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Dead-code elimination from ``nodes`` up through their inputs: erase what has no users
    and no side effects. The cost is that of what is erased, not of the graph."""
    stack = [n for n in nodes if n is not None]
    while stack:
        node = stack.pop()
        if node._erased or node.users or node.op in ("placeholder", "output") or node.is_impure():
            continue
        stack += node.all_input_nodes
        graph.erase_node(node)


def erase_if_unused(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase nodes left without users (wait_tensor is side-effectful, so DCE keeps it)."""
    for node in nodes:
        if node is not None and not node.users:
            graph.erase_node(node)


def sum_in_fp32(emit: Emitter, parts: list[fx.Node], dtype: torch.dtype) -> fx.Node:
    """``parts[0] + parts[1] + ...`` in that order. Low-precision parts are summed in fp32 and
    the sum rounded to ``dtype`` once: the one op they stand for (a matmul, attention's
    backward) accumulates in fp32 and rounds once, and summing rounded partials would lose that."""
    wide = dtype in (torch.bfloat16, torch.float16)
    to = torch.ops.prims.convert_element_type.default
    total = None
    for part in parts:
        part = emit(to, part, torch.float32) if wide and fake(part).dtype != torch.float32 else part
        total = part if total is None else emit(aten.add.Tensor, total, part)
    return emit(to, total, dtype) if wide else total
