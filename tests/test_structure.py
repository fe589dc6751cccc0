"""Single-process structure tests at world size 8 with the fake process group.

A fake group traces and compiles at any world size without communication, so the rewritten
graph of *every* rank can be read: the pass is run on a captured post-grad graph once per rank.
The chunk-order tests read the order from the matmuls' outputs, so they run without fusion
(fusion has its own tests: test_fusion.py).
"""

from __future__ import annotations

import logging
import operator

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from conftest import fake_world
from graphs import CONTROL_DEPS, attention_calls, exchange_args, flash_ag_order, flash_rs_order, is_cut, post_grad_graphs, query_split_calls, rewrite_as, ring_exchanges, sliced_chunk_order, unpinned

import commfuse_compile
from commfuse_compile.p2p import WAIT_EXCHANGE
from commfuse_compile.passes.graph_utils import MATMULS, WAIT

WORLD = 8


@pytest.fixture(scope="module")
def world():
    with fake_world(WORLD, rank=0) as group:
        yield group


@pytest.fixture(scope="module")
def mlp_graphs(world):
    """Post-grad forward and backward graphs of relu(AG(x) @ W1) @ W2 → RS on [B, S, H]."""

    def mlp(x, w1, w2):
        h = funcol.all_gather_tensor(x, 0, world)
        return funcol.reduce_scatter_tensor(torch.relu(h @ w1) @ w2, "sum", 0, world)

    x = torch.randn(2, 3, 8, requires_grad=True)
    w1 = torch.randn(8, 16, requires_grad=True)
    w2 = torch.randn(16, 8, requires_grad=True)
    return post_grad_graphs(mlp, x, w1, w2)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_chunk_order_of_every_rank(mlp_graphs, kind):
    shard = "primals_1" if kind == "forward" else "tangents_1"
    for r in range(WORLD):
        graph, sites, _ = rewrite_as(mlp_graphs[kind], r, kind, pin_order=False, fusion=False)
        assert [s.decision for s in sites] == ["rewrite", "rewrite"], [s.reason for s in sites]

        # Flash-AG: step k computes chunk (r - k) mod N, received after k hops from r - 1.
        assert flash_ag_order(graph, shard) == [[((r - k) % WORLD, k) for k in range(WORLD)]]
        # Flash-RS: step i computes chunk (r - 1 - i) mod N; the rank's own chunk comes last.
        rs_order = flash_rs_order(graph, sites[1])
        assert rs_order == [(r - 1 - i) % WORLD for i in range(WORLD)]
        assert rs_order[-1] == r

        # Both rings: N - 1 transfers each, always to r + 1 and from r - 1, each with its own tag.
        exchanges = ring_exchanges(graph)
        assert len(exchanges) == 2 * (WORLD - 1)
        assert {(n.args[1], n.args[2]) for n in exchanges} == {((r + 1) % WORLD, (r - 1) % WORLD)}
        assert len({n.args[4] for n in exchanges}) == len(exchanges)

        # The record agrees with the graph.
        ag, rs = sites
        assert [s.chunk for s in ag.steps] == [(r - k) % WORLD for k in range(WORLD)]
        assert [s.chunk for s in rs.steps] == rs_order
        assert ag.steps[-1].start is None and rs.steps[0].start is None  # no transfer there


@pytest.fixture(scope="module")
def sp_graphs(world):
    """Gather and scatter on the sequence dim of [B, S/N, H]; two consumers; sums of matmuls."""
    from programs import sequence_parallel

    x = torch.randn(2, 3, 16, requires_grad=True)
    w1, w2 = torch.randn(16, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    return post_grad_graphs(sequence_parallel, x, w1, w2)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_sequence_parallel_chunk_order_of_every_rank(sp_graphs, kind):
    shard = "primals_1" if kind == "forward" else "tangents_1"
    for r in range(WORLD):
        graph, sites, _ = rewrite_as(sp_graphs[kind], r, kind, pin_order=False, fusion=False)
        ag, rs = sites
        assert (ag.decision, ag.dim, rs.decision, rs.dim) == ("rewrite", 1, "rewrite", 1), [s.reason for s in sites]
        expected_ag = [((r - k) % WORLD, k) for k in range(WORLD)]
        # (contraction consumers, e.g. the wgrad in backward, sum their partials: no concat)
        assert flash_ag_order(graph, shard) == [expected_ag] * sum(c.role != "contraction" for c in ag.consumers)
        assert flash_rs_order(graph, rs) == [(r - 1 - i) % WORLD for i in range(WORLD)]
        if kind == "forward":  # q/k-style: one ring feeds both matmuls; y is a sum of two
            assert len(ag.consumers) == 2 and all(len(step.compute) == 2 for step in ag.steps)
            assert len(rs.consumers) == 2 and all(len(step.compute) == 2 for step in rs.steps)
        assert len(ring_exchanges(graph)) == 2 * (WORLD - 1)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_spmd_types_movedim_form_of_every_rank(world, kind):
    """torchtitan's spmd_types moves the sequence dim with movedim + contiguous (permute +
    clone) around both collectives: the same rings on dim 1, every rank of 8."""
    from programs import spmd_layout

    x = torch.randn(2, 3, 16, requires_grad=True)
    w1, w2 = torch.randn(16, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    graphs = post_grad_graphs(spmd_layout, x, w1, w2)
    shard = "primals_1" if kind == "forward" else "tangents_1"
    for r in range(WORLD):
        graph, sites, _ = rewrite_as(graphs[kind], r, kind, pin_order=False, fusion=False)
        ag, rs = sites
        assert (ag.decision, ag.dim, ag.permutation, rs.decision, rs.dim, rs.permutation) == ("rewrite", 1, (1, 0, 2), "rewrite", 1, (1, 0, 2)), [
            s.reason for s in sites
        ]
        if kind == "forward":  # (backward: the wgrad consumer sums partials, no concat)
            assert flash_ag_order(graph, shard) == [[((r - k) % WORLD, k) for k in range(WORLD)]]
        assert flash_rs_order(graph, rs) == [(r - 1 - i) % WORLD for i in range(WORLD)]
        targets = {n.target for n in graph.nodes}
        assert torch.ops._c10d_functional.all_gather_into_tensor.default not in targets
        assert torch.ops._c10d_functional.reduce_scatter_tensor.default not in targets


def test_dtensor_sequence_parallel_split_form_of_every_rank(world):
    """DTensor SP emits split + getitem (not slices) around its collectives: the feed-forward
    half of the Llama block under its TP + SP plan, read back on every rank of 8."""
    from llama import DIM, FFN, tp_plan

    from commfuse_compile.models import FeedForward
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    # Inside a container, so that the input hook (Shard(1) -> Replicate) is part of the graph.
    plan = {k.replace("feed_forward", "0"): v for k, v in tp_plan().items() if k.startswith("feed_forward")}
    ffn = parallelize_module(torch.nn.Sequential(FeedForward(DIM, FFN)), mesh, plan)
    graphs = post_grad_graphs(ffn, torch.randn(2, 2, 32, requires_grad=True))  # [B, S/N, H]
    for kind in ("forward", "backward"):
        for r in range(WORLD):
            graph, sites, _ = rewrite_as(graphs[kind], r, kind, pin_order=False, fusion=False)
            assert [(s.pattern, s.decision, s.dim) for s in sites] == [
                ("all_gather_matmul", "rewrite", 1), ("matmul_reduce_scatter", "rewrite", 1)
            ], [s.reason for s in sites]
            ag, rs = sites
            assert [s.chunk for s in ag.steps] == [(r - k) % WORLD for k in range(WORLD)]
            assert flash_rs_order(graph, rs) == [(r - 1 - i) % WORLD for i in range(WORLD)]
            if kind == "forward":
                assert len(ag.consumers) == 2  # w1 and w3 share one ring
            else:
                assert len(rs.consumers) == 2  # dX of w1 and w3: a sum of two matmuls


def test_weight_gather_columns_and_contraction_of_every_rank(world):
    from programs import weight_gather

    x, w1, w2 = torch.randn(6, 16), torch.randn(16, 32), torch.randn(32, 16)
    graphs = post_grad_graphs(weight_gather, *(t.requires_grad_() for t in (x, w1, w2)))
    (gather,) = [n for n in graphs["forward"].nodes if "all_gather" in n.name]
    shard = gather.args[0].name
    for r in range(WORLD):
        graph, sites, _ = rewrite_as(graphs["forward"], r, "forward", pin_order=False, fusion=False)
        (ag,) = sites
        assert ag.decision == "rewrite", ag.reason
        assert sorted(c.role for c in ag.consumers) == ["columns", "contraction"]
        expected = [((r - k) % WORLD, k) for k in range(WORLD)]
        assert flash_ag_order(graph, shard) == [expected]  # columns: cat along dim 1
        contraction = ag.consumers[[c.role for c in ag.consumers].index("contraction")]
        partials = {step.compute[ag.consumers.index(contraction)].name for step in ag.steps}
        # contraction: step k multiplies the columns of chunk (r - k) of the other operand
        assert sliced_chunk_order(graph, partials) == [c for c, _ in expected]


def test_collectives_are_gone_and_the_gather_is_rebuilt_from_chunks(mlp_graphs):
    graph, sites, _ = rewrite_as(mlp_graphs["forward"], 3, "forward")
    targets = {n.target for n in graph.nodes}
    assert torch.ops._c10d_functional.all_gather_into_tensor.default not in targets
    assert torch.ops._c10d_functional.reduce_scatter_tensor.default not in targets
    # The gathered activation is saved for backward: rebuilt from the pieces, not re-gathered.
    assert any("rebuilt from the pieces" in note for note in sites[0].notes)


def test_pinned_order_adds_control_dependencies(mlp_graphs):
    graph, sites, _ = rewrite_as(mlp_graphs["forward"], 5, "forward")
    control = [n for n in graph.nodes if n.op == "call_function" and "control_deps" in str(n.target)]
    by_name = {n.name: n for n in control}
    for site in sites:
        for step in site.steps:
            if step.start is None:
                continue
            compute = by_name[step.compute[0].name]  # compute waits for nothing but ...
            assert step.start.name in {d.name for d in compute.args[0]}  # ... its transfer's start
            wait = by_name[step.wait.name]
            assert step.compute[0].name in {d.name for d in wait.args[0]}  # wait after compute


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("schedule, m", [("ring", 2), ("bidirectional", 1), ("slicing", 2)])
def test_every_rank_waits_in_one_order(mlp_graphs, kind, schedule, m):
    """Two sub-rings (m = 2, or the two directions) and two sites are independent chains that a
    scheduler could interleave differently per rank (a deadlock at 4 ranks before): every wait
    is pinned after the wait before it, the same chain on every rank."""
    chains = []
    for rank in (0, 3, 6):
        graph, sites, _ = rewrite_as(mlp_graphs[kind], rank, kind, schedule=schedule, chunks_per_rank=m)
        assert [s.decision for s in sites] == ["rewrite"] * len(sites)
        waits = [n for n in graph.nodes if n.name.startswith(("wait_tensor", "wait_exchange"))]
        assert len(waits) > len(sites)
        for before, after in zip(waits, waits[1:]):
            assert "control_deps" in str(after.target) and before in after.args[0], (after, after.args[0])
        chains.append([n.name for n in waits])
    assert chains[0] == chains[1] == chains[2]


def idle_matmuls(graph, sites) -> list[str]:
    """Matmuls that run between a ring's first start and the wait before it although neither
    that start nor a ring needs them: with nothing in flight while they run."""
    nodes = list(graph.nodes)
    ring = {n for site in sites for step in site.steps for n in (step.start, step.wait, *step.compute)}
    idle = []
    for site in sites:
        first = next(step.start for step in site.steps if step.start is not None)
        end = nodes.index(first)
        floor = max((i for i in range(end) if unpinned(nodes[i])[0] in (WAIT, WAIT_EXCHANGE)), default=-1)
        needed, todo = set(), [first]
        while todo:  # (pins are inputs of the pinned node: all_input_nodes follows them too)
            for before in todo.pop().all_input_nodes:
                if before not in needed:
                    needed.add(before)
                    todo.append(before)
        idle += [n.name for n in nodes[floor + 1 : end] if unpinned(n)[0] in MATMULS and n not in needed | ring]
    return idle


@pytest.mark.parametrize("schedule, m", [("ring", 1), ("ring", 2), ("bidirectional", 1), ("slicing", 2)])
def test_free_matmuls_run_while_a_ring_transfers(mlp_graphs, schedule, m):
    """In backward, W1's weight gradient (AG(x)ᵀ @ dh) is needed by neither ring. Unpinned,
    it ran just before the reduce-scatter ring's first transfer, with nothing in flight; it is
    pinned after that start and before the ring's last wait, on every rank."""
    for rank in (0, 5):
        graph, sites, _ = rewrite_as(mlp_graphs["backward"], rank, "backward", schedule=schedule, chunks_per_rank=m)
        assert idle_matmuls(graph, sites) == []
        rs = sites[1]
        pinned = [step for step in rs.steps if step.start is not None]
        first, last_wait = pinned[0].start, pinned[-1].wait
        ring = {n for site in sites for step in site.steps for n in step.compute}
        filled = [n for n in graph.nodes if unpinned(n)[0] in MATMULS and n not in ring and n.target is CONTROL_DEPS and first in n.args[0]]
        assert len(filled) == 1, filled  # W1's weight gradient
        assert filled[0] in last_wait.args[0]


def test_same_plan_on_every_rank(mlp_graphs):
    plans = []
    for r in range(WORLD):
        _, sites, _ = rewrite_as(mlp_graphs["backward"], r, "backward")
        plans.append([(s.pattern, s.decision, s.reason, len(s.steps)) for s in sites])
    assert all(p == plans[0] for p in plans)


def _sites_of(fn, *inputs, **options):
    commfuse_compile.clear_reports()
    torch._dynamo.reset()
    torch.compile(fn, backend="commfuse", options={"schedule": "ring", **options})(*inputs)
    return commfuse_compile.last_report().sites


def test_gather_along_the_last_dim(world):
    """``AG(x, dim=-1) @ W`` (PyTorch's async-TP test form): the gathered dim is contracted, each
    step multiplies a column block of x with the matching row block of W. As the right operand's
    columns (``W @ AG(x, dim=-1)``) it is not cut yet, and says so; through a transpose
    (``W @ AG(x, dim=-1).t()``) the permute is followed and the gathered dim is rows again."""

    def f(x, w):
        return funcol.all_gather_tensor(x, 1, world) @ w

    (site,) = _sites_of(f, torch.randn(4, 2), torch.randn(16, 4))
    assert site.action == "rewritten" and "contraction0" in site.shapes, site.reason
    assert len(site.steps) == WORLD and all(len(step.compute) == 1 for step in site.steps)

    def g(x, w):
        return w @ funcol.all_gather_tensor(x, 1, world)

    (site,) = _sites_of(g, torch.randn(4, 2), torch.randn(3, 4))
    assert site.action == "skipped" and "read as its right operand: not yet supported" in site.reason, site.reason

    def h(x, w):
        return w @ funcol.all_gather_tensor(x, 1, world).t()

    (site,) = _sites_of(h, torch.randn(4, 2), torch.randn(3, 16))
    assert site.action == "rewritten" and (site.dim, site.shapes.get("contraction0")) == (0, [3, 16]), (site.reason, site.shapes)


def test_fp8_sequence_gather_with_chunks_viewed_between_split_and_cat(world):
    """PyTorch's async-TP fp8 form on dim 1 of [B, S/N, H]: the bytes gathered as uint8, each
    chunk viewed as fp8 between the split and the cat. The ring carries uint8 pieces (gloo and
    NCCL send no fp8) and every step's _scaled_mm reads its piece viewed as fp8."""
    fp8 = torch.float8_e4m3fn

    def f(x, w):
        gathered = funcol.all_gather_tensor(x.to(fp8).view(torch.uint8), 0, world)
        a = torch.cat([chunk.view(fp8) for chunk in gathered.chunk(WORLD, 0)], 1)
        w8 = w.to(fp8).t().contiguous().t()
        return torch._scaled_mm(a.flatten(0, 1), w8, torch.full((), 0.5), torch.full((), 2.0), out_dtype=torch.bfloat16)

    graph = post_grad_graphs(f, torch.randn(2, 4, 16), torch.randn(16, 8), backward=False)["inference"]
    for rank in (0, 5):
        rewritten, (site,), _ = rewrite_as(graph, rank, "inference")
        assert site.decision == "rewrite" and site.dim == 1 and site.chunk_dtype == fp8, site.reason
        assert {exchange_args(node)[0].meta["val"].dtype for node in ring_exchanges(rewritten)} == {torch.uint8}
        for step in site.steps:
            (scaled,) = [node for node in step.compute if unpinned(node)[0] is torch.ops.aten._scaled_mm.default]
            assert unpinned(scaled)[1][0].meta["val"].dtype == fp8


def test_skip_chunks_not_concatenated_back_says_so(world):
    def f(x, w):
        first, *_others = funcol.all_gather_tensor(x, 0, world).chunk(WORLD, 0)
        return first @ w

    (site,) = _sites_of(f, torch.randn(4, 8), torch.randn(8, 4))
    assert site.action == "skipped" and "split into its chunks, but they are not concatenated back in order by one cat" in site.reason, site.reason


def test_skip_right_operand_depends_on_gather(world):
    def f(x):
        h = funcol.all_gather_tensor(x, 0, world)
        return h @ h[:16].t()

    (site,) = _sites_of(f, torch.randn(4, 16))
    assert site.action == "skipped" and "depends on the gathered tensor" in site.reason


def test_skip_reduce_scatter_not_fed_by_mm(world):
    def f(x):
        return funcol.reduce_scatter_tensor(x * 2, "sum", 0, world)

    (site,) = _sites_of(f, torch.randn(16, 4))
    assert site.action == "skipped" and "not a matmul or a sum of matmuls" in site.reason


def test_skip_group_size_1(world):
    single = torch.distributed.new_group([0])

    def f(x, w):
        return funcol.all_gather_tensor(x, 0, single) @ w

    (site,) = _sites_of(f, torch.randn(4, 8), torch.randn(8, 4))
    assert site.action == "skipped" and site.reason == "group size 1: nothing to exchange"


def test_skip_disabled_pattern_and_warn_once_when_nothing_rewritten(world, caplog):
    def f(x, w):
        return funcol.all_gather_tensor(x, 0, world) @ w

    with caplog.at_level(logging.INFO, logger="commfuse_compile"):
        (site,) = _sites_of(f, torch.randn(4, 8), torch.randn(8, 4), flash_ag=False)
    assert site.action == "skipped" and site.reason == "disabled by option flash_ag=False"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rewrote nothing" in warnings[0].getMessage()
    # every site is also logged
    assert any("disabled by option flash_ag=False" in r.getMessage() for r in caplog.records)


def test_symbolic_sizes_are_left_alone(world):
    def f(x, w):
        return funcol.all_gather_tensor(x, 0, world) @ w

    commfuse_compile.clear_reports()
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0)
    out = torch.compile(f, backend="commfuse")(x, torch.randn(8, 4))
    assert out.shape == (4 * WORLD, 4)
    (site,) = commfuse_compile.last_report().sites
    assert site.action == "skipped" and "symbolic" in site.reason
    assert site.reason.startswith("dim 0 of [8*s") and "has the symbolic size" in site.reason, site.reason


def test_symbolic_batch_with_a_static_cut_dim_is_rewritten(world):
    """The sequence is gathered (static); the batch is symbolic: rewritten on every rank, the
    symbolic size becoming each reshape's -1, and a size read off the all-gather
    (``sym_size.int``) read off its shard instead."""

    def f(x, w):
        return funcol.all_gather_tensor(x, 1, world) @ w

    x = torch.randn(2, 3, 8, requires_grad=True)
    torch._dynamo.mark_dynamic(x, 0)
    graphs = post_grad_graphs(f, x, torch.randn(8, 4, requires_grad=True))
    graph = graphs["forward"]
    gather = next(n for n in graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default)
    size_user = graph.output_node()  # (the batch, saved for backward, survives the rewrite)
    with graph.inserting_after(gather):  # as Dynamo emits it for `x.shape[0]` of a gathered x
        size = graph.call_function(torch.ops.aten.sym_size.int, (gather, 0))
    size.meta["val"] = gather.meta["val"].shape[0]
    symbol = next(a for a in size_user.args[0] if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.SymInt))
    with graph.inserting_after(size):
        per_rank = graph.call_function(operator.floordiv, (size, WORLD))
    per_rank.meta["val"] = symbol.meta["val"]
    size_user.replace_input_with(symbol, per_rank)
    for kind, g in graphs.items():
        for rank in (0, 5):
            rewritten, sites, _ = rewrite_as(g, rank, kind)
            assert [s.decision for s in sites] == ["rewrite"], [s.reason for s in sites]
            targets = [n.target for n in rewritten.nodes]
            assert torch.ops._c10d_functional.all_gather_into_tensor.default not in targets
            assert torch.ops._c10d_functional.reduce_scatter_tensor.default not in targets
            for node in rewritten.nodes:
                for arg in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
                    assert not isinstance(arg, torch.SymInt), node.format_node()  # no baked-in example size
            if kind == "forward":
                (resized,) = [n for n in rewritten.nodes if n.target is torch.ops.aten.sym_size.int]
                assert (resized.args[0].name, resized.args[1]) == (gather.args[0].name, 0)  # the shard's batch
                (times,) = [n for n in rewritten.nodes if n.target is operator.mul and resized in n.args]
                assert times.args == (resized, WORLD)


def _plain_tp_block(world):
    def block(x, w1, w2, w3):
        """Row-parallel matmul → all-reduce → residual add, RMSNorm → column-parallel matmul."""
        h = x + funcol.all_reduce(torch.relu(x @ w1) @ w2, "sum", world)
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return n @ w3, h

    return block


def test_all_reduce_between_matmuls_is_split_into_flash_rs_and_flash_ag(world):
    """Plain TP: the all-reduce becomes a reduce-scatter (Flash-RS after the row-parallel
    matmul) and an all-gather (Flash-AG before the next matmul); the residual add and the norm
    are computed on each arriving piece, and the residual stream h is rebuilt from them."""
    x = torch.randn(2, 16, 8)
    graphs = post_grad_graphs(_plain_tp_block(world), x, torch.randn(8, 4), torch.randn(4, 8), torch.randn(8, 4), backward=False)
    (graph,) = graphs.values()
    for rank in (0, 5):
        rewritten, sites, _ = rewrite_as(graph, rank, "inference")
        assert [(s.pattern, s.decision) for s in sites] == [
            ("all_reduce", "rewrite"), ("matmul_reduce_scatter", "rewrite"), ("all_gather_matmul", "rewrite")
        ]
        split, scatter, gather = sites
        assert split.dim == 1 and "split on dim 1 into a reduce-scatter (Flash-RS ring" in split.reason
        assert any("rsqrt" in n for note in gather.notes if note.startswith("computed on each piece") for n in note.split(", "))
        targets = [n.target for n in rewritten.nodes]
        collectives = [t for t in targets if getattr(t, "namespace", "") == "_c10d_functional" and t is not torch.ops._c10d_functional.wait_tensor.default]
        assert collectives == []  # both halves are rings now
        assert len(ring_exchanges(rewritten)) == 2 * (WORLD - 1)
        assert targets.count(torch.ops.aten.rsqrt.default) == WORLD  # the norm on each of 8 pieces


def test_all_reduce_left_alone_when_neither_half_decomposes(world):
    def f(x):
        return funcol.all_reduce(x * 2, "sum", world) + 1

    (site,) = _sites_of(f, torch.randn(16, 4))
    assert site.pattern == "all_reduce" and site.action == "skipped"
    assert site.reason.startswith("neither half can be decomposed: reduce-scatter: reduce-scatter input is produced by mul.Tensor")
    (site,) = _sites_of(_plain_tp_block(world), torch.randn(2, 16, 8), torch.randn(8, 4), torch.randn(4, 8), torch.randn(8, 4), flash_ar=False)
    assert site.action == "skipped" and site.reason == "disabled by option flash_ar=False"
    (site,) = _sites_of(lambda x: funcol.all_reduce(x, "max", world), torch.randn(16, 4))
    assert site.reason == "reduce op 'max': only 'sum' and 'avg' split into a reduce-scatter"


def test_all_to_all_steps_and_peers_of_every_rank(world):
    """Flash-All-to-All on an expert-parallel layer: on every rank, each all-to-all is N − 1
    pairwise steps, step k sending to r + k and receiving from r − k (the own block never
    travels), with the expert FFN computed on the blocks as they arrive."""
    import programs

    inputs = programs.make_inputs("expert_parallel", 0, WORLD, torch.float32)
    graphs = post_grad_graphs(programs.expert_parallel, *inputs)
    for kind, graph in graphs.items():
        for r in range(WORLD):
            rewritten, sites, _ = rewrite_as(graph, r, kind)
            assert [(s.pattern, s.decision) for s in sites] == [("all_to_all", "rewrite")] * 2, [s.reason for s in sites]
            peers = [tuple(exchange_args(n)[1:3]) for n in ring_exchanges(rewritten)]
            expected = [((r + k) % WORLD, (r - k) % WORLD) for k in range(1, WORLD)]
            assert peers == expected * 2, (kind, r, peers)
            for site in sites:
                assert [step.chunk for step in site.steps] == [(r - k) % WORLD for k in range(1, WORLD)]
                sent = [exchange_args(step.start)[0] for step in site.steps]
                assert len(set(sent)) == WORLD - 1  # a block of its own per step
            dispatch = sites[0] if kind == "forward" else None
            if dispatch is not None:  # the FFN's matmuls inside the steps, the first ones at step 1
                assert any(unpinned(n)[0] is torch.ops.aten.mm.default for n in dispatch.steps[1].compute)


def test_token_count_exchange_is_never_decomposed(world):
    """MoE routing's count exchange: its result goes to the host (``.tolist()``, the next
    all-to-all's splits), so steps would only delay that sync. A row-local matmul reads it too,
    which would otherwise make it a Flash-All-to-All under ``schedule="ring"``."""
    torch._dynamo.config.capture_scalar_outputs = True

    def route(counts, x, m):
        received = funcol.all_to_all_single(counts.view(WORLD, -1), [1] * WORLD, [1] * WORLD, world)
        out_splits = received.sum(1).tolist()
        tokens = funcol.all_to_all_single(x, out_splits, counts.view(WORLD, -1).sum(1).tolist(), world)
        return tokens, received.float() @ m

    counts = torch.full((WORLD * 2,), 2, dtype=torch.int64)
    report = commfuse_compile.explain(route, counts, torch.randn(WORLD * 4, 8), torch.randn(2, 8), options={"schedule": "ring"}, codegen=False)
    count, tokens = report.sites
    assert count.action == "skipped" and "is read on the host (_local_scalar_dense" in count.reason, count.reason
    assert "decomposing it would only delay that sync" in count.reason
    # (its splits are known only at run time, which is supported; with nothing row-local next
    # to it there is nothing to overlap)
    assert tokens.action == "skipped" and tokens.reason.startswith("no row-local compute before or after the all-to-all"), tokens.reason


def test_runtime_split_steps_sizes_and_peers_of_every_rank(world):
    """An MoE layer whose dispatch and combine splits are the token counts read with
    ``.tolist()``: on every rank of 8, each of the four data all-to-alls (forward and backward)
    is N − 1 steps, step k sending block r + k of a ``split_with_sizes`` by the input splits to
    r + k and receiving from r − k as many rows as the output split of r − k says; the counts
    exchange is left alone. The plan is the same on every rank (it depends on no size)."""
    import routed

    torch._dynamo.config.capture_scalar_outputs = True
    x, w1, w2 = routed.inputs(0, WORLD, torch.float32)
    graphs = post_grad_graphs(routed.routed_moe, x, w1, w2, routed.routing("balanced", 0, WORLD, 0))
    split = torch.ops.aten.split_with_sizes.default
    for kind, graph in graphs.items():
        data = [n for n in graph.nodes if n.target is torch.ops._c10d_functional.all_to_all_single.default and isinstance(n.args[1][0], torch.fx.Node)]
        assert len(data) == 2
        for r in range(WORLD):
            rewritten, sites, _ = rewrite_as(graph, r, kind, pin_order=False)  # (unpinned: a block's inputs are its own)
            decisions = [(s.pattern, s.decision) for s in sites]
            assert decisions == [("all_to_all", "skip")] * (kind == "forward") + [("all_to_all", "rewrite")] * 2, [s.reason for s in sites]
            starts = ring_exchanges(rewritten)
            assert len(starts) == 2 * (WORLD - 1)
            for site, collective, steps in zip(sites[-2:], data, (starts[: WORLD - 1], starts[WORLD - 1 :])):
                out_splits, in_splits = (list(collective.args[i]) for i in (1, 2))
                for k, start in enumerate(steps, start=1):
                    sent, send_to, recv_from, _, _, rows = exchange_args(start)
                    assert (send_to, recv_from) == ((r + k) % WORLD, (r - k) % WORLD)
                    assert rows.name == out_splits[recv_from].name  # the output split of its source
                    origins, stack = set(), [sent]  # what it is computed from (a gate, the expert FFN)
                    while stack:
                        node = stack.pop()
                        if node.target is operator.getitem and node.args[0].target is split:
                            origins.add(("block", node.args[1], tuple(n.name for n in node.args[0].args[1])))
                        elif node.target is WAIT_EXCHANGE:
                            origins.add(("received from", exchange_args(node.args[0])[2]))
                        else:
                            stack += node.all_input_nodes
                    if site is sites[-2]:  # dispatch (or the combine's gradient): block r + k of the input
                        assert origins == {("block", send_to, tuple(n.name for n in in_splits))}, origins
                    else:  # combine: the FFN's output for the tokens that came from r + k, sent straight back
                        assert origins <= {("block", send_to, tuple(n.name for n in in_splits)), ("received from", send_to)}, origins
                assert [step.chunk for step in site.steps] == [(r - k) % WORLD for k in range(1, WORLD)]
            own = [n for n in rewritten.nodes if n.target is torch.ops.aten._assert_scalar.default and "own block" in str(n.args[1])]
            assert len(own) == 2  # the own block's two size symbols asserted equal, per all-to-all


@pytest.mark.parametrize("n", range(2, 9))
def test_moe_ep_steps_pair_every_send_with_its_receive(n):
    """The expert-parallel pipeline's steps at N = 2..8: every dispatch and combine send of
    rank r at step i is received by its peer at step i from r; each source rank's tokens are
    computed on once, the own first, and only after they arrived; each result goes back after
    it was computed."""
    from commfuse_compile.schedules import moe_ep_steps

    plans = [moe_ep_steps(n, r) for r in range(n)]
    for r, steps in enumerate(plans):
        arrived, computed = {r: 0}, {}
        for i, step in enumerate(steps):
            for kind in ("dispatch", "combine"):
                move = getattr(step, kind)
                if move is not None:
                    peer = getattr(plans[move.send_to][i], kind)
                    assert peer is not None and peer.recv_from == r, (n, r, i, kind)
                    if kind == "dispatch":
                        arrived[move.recv_from] = i + 1  # (usable from the next step)
                    else:
                        assert computed[move.send_to] < i  # the results for send_to, computed before
            if step.experts_on is not None:
                assert arrived[step.experts_on] <= i and step.experts_on not in computed
                computed[step.experts_on] = i
        assert steps[0].experts_on == r and sorted(computed) == list(range(n))


def test_moe_ep_pipeline_of_every_rank(world):
    """torchtitan's MoE form (permute, grouped experts, permute back) at EP 8, on every rank:
    one moe_ep site per layer holding its dispatch and combine (no site of its own), 7 dispatch
    and 7 combine steps with the peers of ``moe_ep_steps``, the grouped matmuls on each source
    rank's tokens with offsets ``cumsum(T[j])``, and the values saved for backward put back in
    expert-major order block by block (``index_put`` at the block's positions)."""
    import routed
    from commfuse_compile.schedules import moe_ep_steps

    torch._dynamo.config.capture_scalar_outputs = True
    x, w1, w2 = routed.expert_inputs(0, WORLD, torch.float32)
    graph = post_grad_graphs(routed.grouped_experts, x, w1, w2, routed.expert_routing("balanced", 0, WORLD, 0))["forward"]
    grouped = torch.ops.aten._grouped_mm.default
    for r in range(WORLD):
        rewritten, sites, _ = rewrite_as(graph, r, "forward", pin_order=False)
        assert [(s.pattern, s.decision) for s in sites] == [("all_to_all", "skip"), ("moe_ep", "rewrite")], [s.reason for s in sites]
        expected = [(m.send_to, m.recv_from) for step in moe_ep_steps(WORLD, r) for m in (step.dispatch, step.combine) if m is not None]
        assert [tuple(exchange_args(n)[1:3]) for n in ring_exchanges(rewritten)] == expected
        mms = [n for n in rewritten.nodes if n.target is grouped]
        assert len(mms) == 2 * WORLD  # two grouped matmuls per source rank
        offsets = {n.args[2] for n in mms}
        assert len(offsets) == WORLD and all(o.args[0].target is torch.ops.aten.select.int for o in offsets)
        assert sorted(o.args[0].args[2] for o in offsets) == list(range(WORLD))
        put = torch.ops.aten.index_put.default
        saved = [n for n in rewritten.nodes if n.target is put and n.args[0].target in (torch.ops.aten.empty.memory_format, put)]
        assert saved and len(saved) % WORLD == 0, "each block's saved activations put at their expert-major rows"
        assert not [n for n in rewritten.nodes if n.target is torch.ops._c10d_functional.all_to_all_single.default and n is not sites[0].collective]


def test_an_moe_dispatch_of_another_form_is_left_alone_with_the_reason(world):
    """A dispatch whose tokens are permuted and run through grouped experts, but whose output
    is not combined (put back to token order and returned): not the pipeline's form, said."""
    import routed

    torch._dynamo.config.capture_scalar_outputs = True

    def uncombined(x, w1, expert):
        n, e = WORLD, w1.shape[0]
        counts = (expert.unsqueeze(1) == torch.arange(n * e)).sum(0)
        per_source = funcol.all_to_all_single(counts.view(n, e), None, None, world)
        send, recv = counts.view(n, e).sum(1).tolist(), per_source.sum(1).tolist()
        for size in (*send, *recv):
            torch._check(size >= 0)
        routed_x = funcol.all_to_all_single(x, recv, send, world)
        local = torch.arange(e).repeat(n).repeat_interleave(per_source.reshape(-1), output_size=sum(recv))
        perm = torch.sort(local, stable=True).indices
        offsets = torch.cumsum(per_source.sum(0), 0, dtype=torch.int32)
        y = torch._grouped_mm(routed_x[perm].bfloat16(), w1.bfloat16(), offsets)
        back = y.new_empty(y.shape)
        back[perm] = y
        return back

    x, w1, _ = routed.expert_inputs(0, WORLD, torch.float32)
    w1 = w1[:, :, : x.shape[1]].detach()
    report = commfuse_compile.explain(uncombined, x.detach(), w1, routed.expert_routing("balanced", 0, WORLD, 0), options={"schedule": "ring"}, codegen=False)
    counts, dispatch = report.sites
    assert counts.action == "skipped" and "read on the host" in counts.reason
    assert dispatch.pattern == "moe_ep" and dispatch.action == "skipped"
    assert dispatch.reason.startswith("an MoE dispatch not in the expert-parallel pipeline's form: the experts' output goes back"), dispatch.reason


def test_runtime_split_all_to_all_is_timed_at_balanced_routing(world):
    """``auto`` times a run-time-split all-to-all at balanced routing (the static token count
    cut into N equal blocks: no size only one rank knows) and decides with a reason; the
    estimates are numbers, the same whatever the routing of the traced call."""
    import routed

    torch._dynamo.config.capture_scalar_outputs = True
    x, w1, w2 = routed.inputs(0, WORLD, torch.float32)
    estimates = []
    for kind in ("balanced", "one_rank"):
        graph = post_grad_graphs(routed.routed_moe, x, w1, w2, routed.routing(kind, 0, WORLD, 0))["forward"]
        _, sites, _ = rewrite_as(graph, 3, "forward", schedule="auto", profile="h100-nvlink")
        dispatch = sites[1]
        assert dispatch.reason.startswith(("auto (", "Flash-All-to-All")) and "auto (h100-nvlink)" in dispatch.reason, dispatch.reason
        assert set(dispatch.estimates) == {"vanilla", "ring(m=1)"} and all(type(v) is float for v in dispatch.estimates.values())
        estimates.append(dispatch.estimates)
    assert estimates[0] == estimates[1]


def test_ulysses_steps_compute_projections_and_query_split_attention(world):
    """Ulysses at world size 8: before each of the q / k / v all-to-alls, every step computes
    the projection of the head group it sends (a column block of the weight, one per step);
    before the all-to-all back, every step computes the attention of the query block it sends."""
    import programs

    inputs = programs.make_inputs("ulysses", 0, WORLD, torch.float32)
    graph = post_grad_graphs(programs.ulysses, *inputs)["forward"]
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    for r in (0, 5):
        _, sites, _ = rewrite_as(graph, r, "forward", pin_order=False)  # (pinned, a step's inputs include the previous start)
        assert [(s.pattern, s.decision) for s in sites] == [("all_to_all", "rewrite")] * 4
        for site in sites[:3]:  # the sent block's projection: mm(x, a column block of W)
            sent = [upstream(step.start.args[0], torch.ops.aten.mm.default) for step in site.steps]
            assert all(len(mms) == 1 for mms in sent) and len(set().union(*sent)) == WORLD - 1, site.notes
            assert all(mm.args[1].meta["val"].shape[1] == 16 // WORLD for mms in sent for mm in mms)  # one head's columns
        # the attention of the query block each step sends (block r + k): its diagonal causal,
        # the keys before it in full; the own block's, computed last, is sent by no step
        length = 8  # (the sequence is WORLD blocks of the per-rank 8 rows)
        for k, step in enumerate(sites[3].steps, start=1):
            sent = upstream(step.start.args[0], sdpa)
            assert attention_calls(sent) == query_split_calls(length, [(r + k) % WORLD]), sites[3].notes


def upstream(node, target):
    """The nodes of ``target`` that ``node`` is computed from (itself included)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack += n.all_input_nodes
    return {n for n in seen if n.target is target}


def test_ulysses_backward_steps_compute_attention_backward_by_query_block(world):
    """Ulysses' backward at world size 8: the all-to-all bringing the output gradient computes
    attention's backward one query block at a time as the blocks arrive — at step i the block
    received the step before, the own block at the last step (once its output gradient, which
    the same ring's before side computes last, is there), the last block received after the
    ring — each as the causal diagonal block plus the keys before it in full; no call is left
    on the whole sequence."""
    import programs

    inputs = programs.make_inputs("ulysses", 0, WORLD, torch.float32)
    graph = post_grad_graphs(programs.ulysses, *inputs)["backward"]
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    length = 8  # (the sequence is WORLD blocks of the per-rank 8 rows)
    for r in (0, 5):
        rewritten, sites, _ = rewrite_as(graph, r, "backward", pin_order=False)
        assert [(s.pattern, s.decision) for s in sites] == [("all_to_all", "rewrite")] * 4
        assert "attention backward by query block" in " ".join(sites[0].notes), sites[0].notes
        done: set = set()
        for i, step in enumerate(sites[0].steps):
            calls = {n for c in step.compute for n in upstream(c, backward)} - done
            blocks = ([(r - i) % WORLD] if i else []) + ([r] if i == WORLD - 2 else [])
            assert attention_calls(calls) == query_split_calls(length, blocks), (i, sites[0].notes)
            done |= calls
        everything = [n for n in rewritten.nodes if n.target is backward]
        assert attention_calls(everything) == query_split_calls(length, range(WORLD))


def test_ulysses_projections_of_arriving_head_groups_are_partial_products(world):
    """The matmuls reading an all-to-all's result by column blocks (a head group's columns:
    the output projection after the forward's all-to-all back, dX of q, k and v after the
    backward's three) contract over the blocks: a step multiplies the block that arrived by
    the weight's matching rows, and the products are summed after the ring. Without a before
    side every step has one (the own block first); with one (the all-to-all back, after
    query-split attention) the first step has none and the last block's comes after the ring."""
    import programs

    inputs = programs.make_inputs("ulysses", 0, WORLD, torch.float32)
    graphs = post_grad_graphs(programs.ulysses, *inputs)
    for kind, indices in (("forward", [3]), ("backward", [1, 2, 3])):
        _, sites, _ = rewrite_as(graphs[kind], 5, kind, pin_order=False)
        for i in indices:
            products = [[n for n in step.compute if n.target is torch.ops.aten.mm.default] for step in sites[i].steps]
            counts = [len(p) for p in products]
            assert counts == ([1] * (WORLD - 1) if kind == "backward" else [0] + [1] * (WORLD - 3) + [2]), (kind, i, counts, sites[i].notes)
            for mm in (mm for p in products for mm in p):
                a, b = mm.args
                assert is_cut(b) and b.args[1] == 0 and a.meta["val"].shape[1] == b.meta["val"].shape[0], (kind, i, mm.args)


def test_ulysses_backward_with_a_mask_is_computed_whole_with_the_reason(world):
    """A masked attention's backward is not cut (yet): the all-to-all bringing its gradient
    still overlaps its other side, and its note says why attention's backward is whole."""
    import functools

    import programs

    inputs = programs.make_inputs("ulysses", 0, WORLD, torch.float32)
    graph = post_grad_graphs(functools.partial(programs.ulysses, masked=True), *inputs)["backward"]
    _, sites, _ = rewrite_as(graph, 3, "backward", pin_order=False)
    assert [(s.pattern, s.decision) for s in sites] == [("all_to_all", "rewrite")] * 4
    notes = " ".join(sites[0].notes)
    assert "_scaled_dot_product_flash_attention_for_cpu_backward is computed whole (a mask (not yet cut in the backward))" in notes, notes


@pytest.mark.parametrize("program", ["plain_tp", "sequence_parallel", "attention"])
def test_a_site_computes_each_view_and_piece_once(world, program):
    """A ring asks for the same rows many times (each matmul of a step reshapes the step's
    chunk, each term of a sum cuts the same piece, two ops computed on pieces read the same
    input's): within one site's nodes no view, piece, copy or piecewise op is emitted twice
    with the same arguments, which would be one more node to lower and call per repeat."""
    import programs
    from commfuse_compile.passes.graph_utils import REUSABLE, frozen

    inputs = programs.make_inputs(program, 0, WORLD, torch.float32)
    graphs = post_grad_graphs(programs.PROGRAMS[program][0], *inputs)
    checked = 0
    for kind, graph in graphs.items():
        _, sites, _ = rewrite_as(graph, 3, kind, chunks_per_rank=2, pin_order=False)
        for site in sites:
            seen: dict[tuple, torch.fx.Node] = {}
            for node in site.emitted:
                target = node.target
                pure = target in REUSABLE or isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
                if node.op != "call_function" or not pure:
                    continue
                key = (target, frozen(node.args), frozen(node.kwargs))
                assert key not in seen, f"{kind}: {node.name} repeats {seen[key].name}: {target}{node.args}"
                seen[key] = node
                checked += 1
    assert checked > 0
