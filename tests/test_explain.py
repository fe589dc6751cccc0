"""Inspection in one process: ``fake_world`` + ``explain`` → Report (fields, summary, DOT,
Chrome trace), at a world size no test machine has."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse_compile
from commfuse_compile import Report, explain, fake_world
from commfuse_compile.report import merge_reports

WORLD = 8


def mlp(x, w1, w2):
    group = dist.group.WORLD
    h = funcol.all_gather_tensor(x, 0, group)
    return funcol.reduce_scatter_tensor(torch.relu(h @ w1) @ w2, "sum", 0, group)


@pytest.fixture(scope="module")
def report() -> Report:
    with fake_world(WORLD):
        inputs = [torch.randn(4, 16), torch.randn(16, 32), torch.randn(32, 16)]
        return explain(mlp, *(t.requires_grad_() for t in inputs), options={"schedule": "ring", "chunks_per_rank": 2})


def test_explain_records_every_match_of_forward_and_backward(report):
    assert isinstance(report, Report)
    matches = [(m.graph, m.kind, m.decision) for m in report.matches]
    assert sorted(matches) == sorted(
        (g, k, "ring") for g in ("forward", "backward") for k in ("all_gather_matmul", "matmul_reduce_scatter")
    )
    for m in report.matches:
        assert m.group_size == WORLD and m.dim == 0 and m.shapes and m.reason
        assert m.chunks_per_rank == 2 and "vanilla" in m.estimates and "ring(m=2)" in m.estimates
        assert len(m.steps) == 2 * WORLD  # N steps of m = 2 pieces each


def test_explain_without_codegen_records_the_same(report):
    """codegen=False stops after Inductor's post-grad passes: the same matches, steps and
    rewritten graphs, no kernels."""
    with fake_world(WORLD):
        inputs = [torch.randn(4, 16), torch.randn(16, 32), torch.randn(32, 16)]
        planned = explain(mlp, *(t.requires_grad_() for t in inputs), options={"schedule": "ring", "chunks_per_rank": 2}, codegen=False)

    def essence(r: Report) -> list:
        return [(m.graph, m.kind, m.decision, m.reason, m.shapes, len(m.steps), m.fused) for m in r.matches]

    assert essence(planned) == essence(report)
    # Copies, made GraphModules (their Python code generated) only when read, merged as they are.
    unbuilt = [kind for kind, entry in planned.graphs.entries() if not isinstance(entry, torch.fx.GraphModule)]
    assert unbuilt == ["forward", "backward"]
    assert not any(isinstance(entry, torch.fx.GraphModule) for _, entry in merge_reports([planned]).graphs.entries())
    for kind, graph in planned.graphs.items():
        assert len(graph.graph.nodes) == len(report.graphs[kind].graph.nodes)
    assert planned.graphs["backward"] is planned.graphs["backward"]
    assert all(isinstance(entry, torch.fx.GraphModule) for _, entry in planned.graphs.entries())


def test_explain_keeps_the_rewritten_graphs(report):
    assert set(report.graphs) == {"forward", "backward"}
    for graph in report.graphs.values():
        assert isinstance(graph, torch.fx.GraphModule)
        targets = {str(n.target) for n in graph.graph.nodes}
        assert not any("all_gather_into_tensor" in t or "reduce_scatter_tensor" in t for t in targets)
        assert any("ring_exchange" in t for t in targets)


def test_summary_is_a_table_with_a_row_and_a_reason_per_match(report):
    lines = report.summary().splitlines()
    assert lines[1].split()[:4] == ["#", "graph", "kind", "group"]
    rows = [line for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == len(report.matches) and all("ring(m=2)" in row for row in rows)
    assert sum(line.lstrip().startswith("#") and ":" in line for line in lines) == len(report.matches)


def test_to_dot_draws_the_ring_of_a_match(report, tmp_path):
    path = report.to_dot(str(tmp_path / "ring.dot"))
    dot = open(path).read()
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    site = report.matches[0]
    for step in site.steps:  # every pinned start / wait of the match is drawn ...
        for name in filter(None, (step.start, step.wait)):
            assert f'"{name}" [' in dot
    assert "style=dashed" in dot  # ... with the pinned order as dashed edges
    with pytest.raises(ValueError, match="rewritten matches"):
        Report(0, {}, sites=[]).to_dot(str(tmp_path / "none.dot"))


def test_to_chrome_trace_has_vanilla_and_the_chosen_schedule_per_match(report, tmp_path):
    path = tmp_path / "trace.json"
    report.to_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert len(names) == 2 * len(report.matches)
    assert {n.rsplit(": ", 1)[1] for n in names} == {"vanilla", "ring(m=2)"}
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"compute", "link+", "collective"} <= lanes
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == sum(len(e.timeline.events) for m in report.matches for e in m.modeled)


def test_explain_refuses_to_communicate():
    with pytest.raises(RuntimeError, match="fake_world"):
        explain(mlp, torch.randn(4, 16), torch.randn(16, 32), torch.randn(32, 16))


def test_fake_world_checks_its_arguments():
    with pytest.raises(ValueError, match="world_size"):
        with fake_world(0):
            pass
    with pytest.raises(ValueError, match="rank"):
        with fake_world(4, rank=4):
            pass
    with fake_world(4, rank=3) as group:
        assert (dist.get_rank(), dist.get_world_size(), group) == (3, 4, dist.group.WORLD)
    assert not dist.is_initialized()


def test_the_backend_reports_the_same_type(report):
    assert isinstance(commfuse_compile.last_report(), Report)


def test_all_to_all_in_the_summary_dot_and_trace(tmp_path):
    """Flash-All-to-All shows like the rings: a row per match, its pairwise steps in the DOT, its
    modelled steps (vanilla and ring) in the Chrome trace."""

    def dispatch(x, w):
        routed = funcol.all_to_all_single(x * 2, None, None, dist.group.WORLD)
        return torch.relu(routed @ w)

    with fake_world(WORLD):
        report = explain(dispatch, torch.randn(32, 16), torch.randn(16, 16), options={"schedule": "ring"})
    (site,) = report.matches
    assert site.pattern == "all_to_all" and site.action == "rewritten" and len(site.steps) == WORLD - 1
    assert "all_to_all" in report.summary()
    dot = open(report.to_dot(str(tmp_path / "a2a.dot"))).read()
    assert all(f'"{step.start}" [' in dot for step in site.steps)
    report.to_chrome_trace(str(tmp_path / "a2a.json"))
    names = {e["args"]["name"] for e in json.loads((tmp_path / "a2a.json").read_text())["traceEvents"] if e["name"] == "process_name"}
    assert {n.rsplit(": ", 1)[1] for n in names} == {"vanilla", "ring(m=1)"}


def test_moe_pipeline_in_the_summary_dot_and_trace(tmp_path):
    """An MoE layer with runtime splits (torchtitan's form) shows as one moe_ep match: its
    dispatch and combine steps in the DOT, its modelled pipeline in the Chrome trace; the
    token-count exchange as a skip with its reason."""
    import routed

    torch._dynamo.config.capture_scalar_outputs = True
    with fake_world(WORLD):
        x, w1, w2 = routed.expert_inputs(0, WORLD, torch.float32)
        report = explain(routed.grouped_experts, x, w1, w2, routed.expert_routing("balanced", 0, WORLD, 0), options={"schedule": "ring"}, codegen=False)
    counts, moe = (s for s in report.sites if s.graph == "forward")
    assert counts.action == "skipped" and "read on the host" in counts.reason
    assert moe.pattern == "moe_ep" and moe.action == "rewritten" and len(moe.steps) == 2 * (WORLD - 1)
    assert "moe_ep" in report.summary()
    dot = open(report.to_dot(str(tmp_path / "moe.dot"))).read()
    assert all(f'"{step.start}" [' in dot for step in moe.steps)
    report.to_chrome_trace(str(tmp_path / "moe.json"))
    names = {e["args"]["name"] for e in json.loads((tmp_path / "moe.json").read_text())["traceEvents"] if e["name"] == "process_name"}
    assert {n.rsplit(": ", 1)[1] for n in names if "moe_ep" in n} == {"vanilla", "ring(m=1)"}
