"""Capture post-grad graphs (as the commfuse pass would see them) and read rewritten rings back."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

from commfuse_compile.explain import _post_grad_only
from commfuse_compile.options import CommfuseOptions
from commfuse_compile.passes import graph_kind, run_pipeline
from commfuse_compile.report import new_report
from commfuse_compile.passes.graph_utils import MM, GraphSnapshot

aten = torch.ops.aten
CONTROL_DEPS = torch.ops.higher_order.control_deps
RING_EXCHANGE = torch.ops.commfuse.ring_exchange.default
PIECE, CONTIGUOUS = torch.ops.commfuse.piece.default, torch.ops.commfuse.contiguous.default


class _Capture(CustomInferenceAwareGraphPass):
    def __init__(self):
        self.graphs: list[tuple[str, fx.Graph]] = []

    def __call__(self, graph: fx.Graph, is_inference: bool) -> None:
        self.graphs.append((graph_kind(graph, is_inference), GraphSnapshot(graph).saved))

    def uuid(self) -> None:
        return None  # never served from a cache: we need the pass to run


def post_grad_graphs(fn, *inputs: torch.Tensor, backward: bool = True) -> dict[str, fx.Graph]:
    """The post-grad graphs Inductor builds for ``fn`` (and its backward), keyed by kind."""
    capture = _Capture()

    def backend(gm, example_inputs):  # (no code generated: the graphs run as they were)
        return compile_fx(
            gm,
            example_inputs,
            inner_compile=_post_grad_only,
            config_patches={"post_grad_custom_post_pass": capture, "fx_graph_cache": False},
        )

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(*inputs)
    if backward:
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.sum() for o in outs).backward()
    return dict(capture.graphs)


def rewrite_as(graph: fx.Graph, rank: int, kind: str, **options):
    """Run the pipeline on a copy of ``graph`` as ``rank`` would (ring schedule unless
    ``options`` say otherwise); returns the rewritten graph, its sites and the report."""
    graph = copy_graph(graph)
    report = new_report({})
    options = {"schedule": "ring", **options}
    sites = run_pipeline(graph, CommfuseOptions(**options), kind, report, rank_of=lambda _: rank)
    return graph, sites, report


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy owned by a GraphModule, as Inductor's graphs are (control_deps needs the owner)."""
    return fx.GraphModule(torch.nn.Module(), GraphSnapshot(graph).saved).graph


def is_collective(target) -> bool:
    """A functional collective's op (not its ``wait_tensor``)."""
    return getattr(target, "namespace", None) == "_c10d_functional" and target is not torch.ops._c10d_functional.wait_tensor.default


def unpinned(node: fx.Node) -> tuple[object, tuple]:
    """The op ``node`` runs and its arguments, also when pinning wrapped it in ``control_deps``
    (its subgraph runs the op on the call's inputs after the dependencies)."""
    if node.target is not CONTROL_DEPS:
        return node.target, node.args
    subgraph = getattr(node.graph.owning_module, node.args[1].target).graph
    (op,) = [n for n in subgraph.nodes if n.op == "call_function"]
    inputs = [n for n in subgraph.nodes if n.op == "placeholder" and n.name.startswith("arg_")]
    by_placeholder = dict(zip(inputs, node.args[2:]))
    return op.target, fx.node.map_arg(op.args, lambda p: by_placeholder.get(p, p))


def ring_exchanges(graph: fx.Graph) -> list[fx.Node]:
    """The ring exchange starts of ``graph``, pinned or not."""
    return [n for n in graph.nodes if unpinned(n)[0] is RING_EXCHANGE]


def exchange_args(node: fx.Node) -> tuple:
    """(tensor sent, send_to, recv_from, group_name, tag) of a ring exchange start."""
    target, args = unpinned(node)
    assert target is RING_EXCHANGE, node
    return args


def hops_from(node: fx.Node, source: fx.Node) -> int | None:
    """Ring hops between ``source`` and ``node`` following reshape / wait / ring_exchange inputs."""
    hops = 0
    while node is not source:
        target, args = unpinned(node)
        if target is RING_EXCHANGE:
            hops += 1
        if not args or not isinstance(args[0], fx.Node):
            return None
        node = args[0]
    return hops


def _through_reshapes(node: fx.Node) -> fx.Node:
    while node.target in (aten.reshape.default, aten.view.default, aten.permute.default, CONTIGUOUS):
        node = node.args[0]
    return node


def is_cut(node: fx.Node) -> bool:
    """A piece of a tensor at an offset, as the pass emits it: ``aten.slice`` or ``commfuse.piece``
    (both ``(tensor, dim, start, end)``)."""
    return node.target in (aten.slice.Tensor, PIECE)


def _hops_to_chunk(mm: fx.Node, source: fx.Node) -> int | None:
    """Hops travelled by the chunk a matmul reads, through whichever operand holds it."""
    hops = [hops_from(operand, source) for operand in mm.args[:2]]
    return next((h for h in hops if h is not None), None)


def flash_ag_order(graph: fx.Graph, shard: str) -> list[list[tuple[int, int]]]:
    """Per consumer matmul: (chunk, hops) of its chunk matmuls in graph order. The chunk index
    is the matmul's position in the output concatenation, hops how far its input travelled."""
    source = next(n for n in graph.nodes if n.name == shard)
    order = {node: i for i, node in enumerate(graph.nodes)}
    consumers = []
    for node in graph.nodes:
        if node.target is aten.cat.default:
            inputs = [_through_reshapes(a) for a in node.args[0]]
            if all(i.target is MM for i in inputs):
                steps = sorted(range(len(inputs)), key=lambda chunk: order[inputs[chunk]])
                consumers.append([(chunk, _hops_to_chunk(inputs[chunk], source)) for chunk in steps])
    return consumers


def sliced_chunk_order(graph: fx.Graph, names: set[str]) -> list[int]:
    """For the matmuls named ``names``, in graph order: which chunk of their sliced left operand
    they read (consecutive matmuls on the same chunk count once)."""
    order: list[int] = []
    for node in graph.nodes:
        if node.name in names:
            target, args = unpinned(node)
            _, dim, start, end = _through_reshapes(args[1] if target is aten.addmm.default else args[0]).args[:4]
            chunk = start // (end - start)
            if not order or order[-1] != chunk:
                order.append(chunk)
    return order


def flash_rs_order(graph: fx.Graph, site) -> list[int]:
    """The chunk computed at each step of ``site``'s Flash-RS ring, read from the row slices
    its matmuls take."""
    return sliced_chunk_order(graph, {node.name for step in site.steps for node in step.compute})


def attention_calls(nodes) -> list[tuple[int, int, int, bool]]:
    """For each attention node: (query rows, first key, end of keys, causal), the keys read off
    the slice it is given (or all of them), sorted; a mask is an error here (none is expected)."""
    from commfuse_compile.passes.attention import arguments, mask_name

    calls = []
    for node in nodes:
        named = arguments(node.target, node.args, node.kwargs)
        assert named.get(mask_name(node.target) or "") is None, f"{node.name} has a mask"
        key, causal = named["key"], named["is_causal"]
        begin, end = (key.args[2], key.args[3]) if is_cut(key) else (0, key.meta["val"].shape[2])
        calls.append((node.args[0].meta["val"].shape[2], begin, end, bool(causal)))
    return sorted(calls)


def query_split_calls(length: int, pieces) -> list[tuple[int, int, int, bool]]:
    """The calls query-split causal attention makes for query pieces ``pieces`` of ``length``
    rows: the diagonal block causal, and (but for the first piece) the keys before it in full."""
    calls = [(length, q * length, (q + 1) * length, True) for q in pieces]
    return sorted(calls + [(length, 0, q * length, False) for q in pieces if q])

