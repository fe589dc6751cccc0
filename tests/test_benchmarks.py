"""The benchmarks run end to end at smoke sizes and write the JSON their readers expect.

The smoke tests are ``slow`` (each spawns processes and compiles): they check the machinery,
not the numbers. The sizing and parsing helpers are checked without spawning anything.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)  # the benchmarks are scripts; spawned ranks inherit sys.path

import compile_time  # noqa: E402
import model_step  # noqa: E402
import moe_memory  # noqa: E402
import peak_memory  # noqa: E402
import step_models  # noqa: E402
import step_time  # noqa: E402


def _run(main, argv: list[str], path) -> dict:
    assert main([*argv, "--json", str(path)]) == 0
    with open(path) as f:
        return json.load(f)


def _has_machine_info(results: dict) -> None:
    assert {"cpu_model", "cores", "torch", "date"} <= set(results["machine"])


@pytest.mark.slow
def test_step_time_smoke(tmp_path):
    # Plain loopback and two of the variants: the namespace and the other four compile the same way.
    results = _run(step_time.main, ["--quick", "--no-shape", "--rounds", "2", "--settle-rounds", "2", "--variants", "inductor,inductor-reorder,ring"], tmp_path / "step.json")
    _has_machine_info(results)
    assert results["benchmark"] == "step_time" and results["shaped"] is False
    assert results["world_size"] == 2 and {"S", "H", "F"} <= set(results["sizes"])
    assert set(results["variants"]) == {"inductor", "inductor-reorder", "ring"}
    # Whether the peer's passes changed its generated code is reported (at these tiny sizes
    # they move nothing; test_reorder_peer_runs_its_passes shows they do at larger ones).
    check = results["peer_checks"]["inductor-reorder"]
    assert check["versus"] == "inductor" and check["graphs"] == 2 and isinstance(check["changed"], bool), check
    for name, variant in results["variants"].items():
        assert {"median_ms", "min_ms", "max_ms", "ratio_to_inductor", "saving_fraction", "compile_s", "sites"} <= set(variant)
        assert len(variant["times_ms"]) == 2 and variant["median_ms"] > 0
    assert results["variants"]["inductor"]["ratio_to_inductor"] == pytest.approx(1.0)
    assert any(site["action"] == "rewritten" for site in results["variants"]["ring"]["sites"])
    # The first settling round cannot be judged settled (nothing to compare with): both ran.
    assert len(results["settling_rounds_ms"]) == 2 and len(results["round_medians_ms"]) == 2
    parts = results["parts"]
    assert parts["ideal_ms"] == max(parts["compute_ms"], parts["comm_ms"]) > 0


@pytest.mark.slow
def test_model_step_smoke(tmp_path):
    # torchtitan's Llama3 at a tiny size, plain loopback, three of the variants: the others
    # differ only in their backend's settings.
    argv = ["--quick", "--no-shape", "--variants", "inductor,inductor-overlap,ring"]
    results = _run(model_step.main, argv, tmp_path / "model_step.json")
    _has_machine_info(results)
    assert results["benchmark"] == "model_step" and results["model"] == "llama3" and results["world_size"] == 2
    assert list(results["rates"]) == ["unshaped"]
    at = results["rates"]["unshaped"]
    assert set(at["variants"]) == {"inductor", "inductor-overlap", "ring"}
    for variant in at["variants"].values():
        assert len(variant["times_ms"]) == 1 and variant["median_ms"] > 0
    assert at["variants"]["inductor"]["ratio_to_inductor"] == pytest.approx(1.0)
    # Both blocks' gathers and scatters, forward and backward, rewritten by the ring.
    assert sum(site["action"] == "rewritten" for site in results["sites"]["ring"]) == 8, results["sites"]["ring"]
    # The step's collectives were recorded and replayed; compute alone ran on the fake group.
    assert results["collectives_per_step"] > 8 and at["comm_ms"] > 0 and results["compute_ms"] > 0
    # Every recorded collective (eager DTensor's in-place c10d gathers and scatters, the loss's
    # functional all-reduces) is moved as ring steps in comm-ring, none merely replayed.
    assert results["collectives_as_ring_steps"] == results["collectives_per_step"], results
    assert at["ideal_ms"] == max(results["compute_ms"], min(at["comm_ms"], at["comm_ring_ms"]))
    check = results["peer_checks"]["inductor-overlap"]
    assert check["graphs"] >= 2 and isinstance(check["changed"], bool), check
    # One profiled step of every variant, and of compute alone, sorted into parts and phases.
    for name, breakdown in {**at["breakdowns"], "compute alone": results["compute_breakdown"]}.items():
        assert sum(breakdown["parts_ms"].values()) == pytest.approx(breakdown["step_ms"], rel=1e-6), name
        assert {"forward", "loss", "backward", "grad clipping", "optimizer"} <= set(breakdown["phases"]), name
        assert breakdown["parts_ms"]["matmul"] > 0, name
    assert at["breakdowns"]["ring"]["parts_ms"]["starting transfers"] > 0
    assert len(at["breakdowns"]["ring"]["blocked_per_rank_ms"]) == 2


def test_breakdown_sorts_ops_into_parts():
    import _breakdown

    assert _breakdown.part_of("_c10d_functional::wait_tensor") == "waiting for transfers"
    assert _breakdown.part_of("commfuse::ring_exchange") == "starting transfers"
    assert _breakdown.part_of("c10d::allgather_into_tensor_coalesced_") == "starting transfers"
    assert _breakdown.part_of("aten::mm") == "matmul"
    assert _breakdown.part_of("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert _breakdown.part_of("## Call CompiledFxGraph abc ##") == "compiled kernels"
    assert _breakdown.part_of("FSDP::pre_forward (layers.0)") == "DTensor and FSDP"
    assert _breakdown.part_of("_ReduceScatterShard") == "eager collectives"
    assert _breakdown.part_of("_AllGatherShardBackward") == "eager collectives"
    assert _breakdown.part_of("aten::add_") == "other ops"


def test_breakdown_of_a_profiled_step():
    import _breakdown
    import torch
    from titan_trainer import phase

    a = torch.randn(256, 256)

    def step():
        with phase("forward"):
            for _ in range(4):
                torch.mm(a, a)
        with phase("optimizer"):
            a.add(1.0)

    result = _breakdown.profile_median_step(step, count=3)
    assert len(result["profiled_steps_ms"]) == 3 and result["step_ms"] == sorted(result["profiled_steps_ms"])[1]
    assert result["parts_ms"]["matmul"] > 0 and result["parts_ms"]["other ops"] > 0
    assert sum(result["parts_ms"].values()) == pytest.approx(result["step_ms"], rel=1e-6)
    assert set(result["phases"]) == {"forward", "optimizer"}
    assert result["phases"]["forward"]["ms"] >= result["parts_ms"]["matmul"] and result["phases"]["forward"]["waiting_ms"] == 0
    assert ["aten::mm", "matmul"] in [op[:2] for op in result["top_ops"]]


def sequence_parallel_mlp(x, w1, w2):
    """all-gather → matmul → relu → matmul → reduce-scatter: the peers' test program."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    h = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    return funcol.reduce_scatter_tensor(torch.relu(h @ w1) @ w2, "sum", 0, dist.group.WORLD)


def test_overlap_peer_runs_on_cpu():
    """model_step's ``inductor-overlap`` peer: Inductor's overlap scheduler, given CPU estimates,
    compiles on CPU and moves an independent matmul between an all-gather's start and its
    wait (plain Inductor waits first). Single process, fake group; read from the generated code."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from _common import run_and_keep_code, schedule_of
    from _overlap_peer import overlap_scheduler_config
    from torch._inductor.compile_fx import compile_fx

    import commfuse_compile

    def layer(x, y, w1, w2):
        gathered = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
        independent = y @ w2
        return gathered @ w1, independent

    codes = {}
    with commfuse_compile.fake_world(2):
        inputs = [torch.randn(256, 512)] + [torch.randn(512, 512, requires_grad=True) for _ in range(3)]  # (a training graph)
        for name, patches in (("inductor", {}), ("inductor-overlap", overlap_scheduler_config(50e9, 125e6))):
            torch._dynamo.reset()
            backend = lambda gm, example, patches=patches: compile_fx(gm, example, config_patches=patches)  # noqa: E731
            with torch._inductor.config.patch(fx_graph_cache=False):
                compiled = torch.compile(layer, backend=backend)
                _, codes[name] = run_and_keep_code(lambda: sum(out.sum() for out in compiled(*inputs)).backward())
    torch._dynamo.reset()
    plain, overlapped = (schedule_of(codes[name][0]) for name in ("inductor", "inductor-overlap"))
    assert plain[:3] == ["all_gather_into_tensor", "wait_tensor", "mm"], plain
    start = overlapped.index("all_gather_into_tensor")
    assert "mm" in overlapped[start : overlapped.index("wait_tensor", start)], overlapped


@pytest.mark.slow
def test_step_time_ulysses_smoke(tmp_path):
    # The Ulysses layer: its four all-to-alls rewritten forward and backward under the ring
    # (the ring alone: the Inductor variant runs the same way as in the MLP's smoke test).
    results = _run(step_time.main, ["--model", "ulysses", "--quick", "--no-shape", "--rounds", "1", "--variants", "ring"], tmp_path / "ulysses.json")
    assert results["model"] == "ulysses" and set(results["variants"]) == {"ring"}
    assert results["variants"]["ring"]["ratio_to_inductor"] is None
    sites = results["variants"]["ring"]["sites"]
    assert [(s["graph"], s["pattern"], s["action"]) for s in sites] == [(g, "all_to_all", "rewritten") for g in ("forward", "backward") for _ in range(4)]
    assert results["parts"]["comm_ms"] > 0 and results["parts"]["compute_ms"] > 0


@pytest.mark.slow
def test_step_time_moe_smoke(tmp_path):
    # The expert-parallel MoE layer: the count exchange left alone, each direction's dispatch →
    # experts → combine one moe_ep pipeline; comm-only runs the routing's uneven all-to-alls.
    results = _run(step_time.main, ["--model", "moe-skewed", "--quick", "--no-shape", "--rounds", "1", "--variants", "ring"], tmp_path / "moe.json")
    sites = results["variants"]["ring"]["sites"]
    assert [(s["graph"], s["pattern"], s["action"]) for s in sites] == [
        ("forward", "all_to_all", "skipped"), ("forward", "moe_ep", "rewritten"), ("backward", "moe_ep", "rewritten")
    ]
    assert results["parts"]["comm_ms"] > 0 and results["parts"]["compute_ms"] > 0


@pytest.mark.slow
def test_compile_time_smoke(tmp_path):
    # One block, commfuse only: the Inductor baseline is the same measurement without options.
    results = _run(compile_time.main, ["--quick", "--backends", "commfuse"], tmp_path / "compile.json")
    _has_machine_info(results)
    assert results["benchmark"] == "compile_time"
    (row,) = results["results"]
    assert row["blocks"] == 1 and "inductor" not in row
    measured = row["commfuse"]
    assert {"total_s", "forward_s", "backward_s", "pass_s", "pass_fraction", "rewritten", "sites"} <= set(measured)
    assert 0 < measured["pass_s"] < measured["total_s"]
    assert measured["rewritten"] > 0
    assert 0 < measured["unique_kernels"] <= measured["kernels"]


@pytest.mark.slow
def test_peak_memory_smoke(tmp_path):
    results = _run(peak_memory.main, ["--quick", "--schedules", "off,ring"], tmp_path / "memory.json")
    _has_machine_info(results)
    assert results["benchmark"] == "peak_memory" and results["world_size"] == 2
    assert set(results["schedules"]) == {"off", "ring"}
    for schedule in results["schedules"].values():
        assert {"peak_increase_rank0", "peak_increase_max", "analytic", "sites"} <= set(schedule)
        assert len(schedule["ranks"]) == 2 and schedule["peak_increase_max"] >= 0
    assert results["schedules"]["off"]["sites"][0]["action"] == "skipped"
    assert results["schedules"]["ring"]["sites"][0]["action"] == "rewritten"
    assert results["full_product_bytes"] == 512 * 1024 * 4


def test_step_time_sizes_meet_the_ratio():
    sizes = step_models.WORKLOADS["mlp"].plan_sizes(2, 50e6, 80e9, compute_ms=400, comm_ratio=0.5)
    assert sizes["estimated_comm_ms"] / sizes["estimated_compute_ms"] == pytest.approx(0.5, rel=0.1)
    assert sizes["estimated_compute_ms"] == pytest.approx(400, rel=0.2)
    assert sizes["S"] % (2 * 32) == 0 and sizes["F"] % (2 * 16) == 0


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_sizes_meet_the_targets(world):
    # At its default link (1gbit) the layer meets the compute target with whole heads of 32k columns.
    sizes = step_models.WORKLOADS["ulysses"].plan_sizes(world, step_time.rate_bytes_per_second("1gbit"), 140e9, compute_ms=400, comm_ratio=0.5)
    assert sizes["estimated_compute_ms"] == pytest.approx(400, rel=0.1)
    assert 0.25 < sizes["estimated_comm_ms"] / sizes["estimated_compute_ms"] < 1.0
    heads = world * step_models.ULYSSES_HEADS_PER_RANK
    assert sizes["H"] % (32 * heads) == 0 and sizes["S"] % (32 * world) == 0


def test_step_time_rejects_a_schedule_the_model_cannot_use():
    with pytest.raises(SystemExit):
        step_time.parse_args(["--model", "ulysses", "--variants", "inductor,slicing"])


def test_compile_time_device_option():
    assert compile_time.parse_args(["--device", "cuda"]).device == "cuda"
    assert compile_time.parse_args([]).device == "cpu"
    assert compile_time.parse_args(["--backends", "inductor,commfuse-no-pin"]).backends == ["inductor", "commfuse-no-pin"]
    with pytest.raises(SystemExit):
        compile_time.parse_args(["--device", "tpu"])


def test_compile_time_world_sizes():
    assert compile_time.parse_args([]).world_sizes == [4]
    assert compile_time.parse_args(["--world-size", "2,4,8"]).world_sizes == [2, 4, 8]
    for bad in ("3", "4,x", ""):
        with pytest.raises(SystemExit):
            compile_time.parse_args(["--world-size", bad])
    measured = {"total_s": 2.0, "total_s_min": 2.0, "total_s_max": 2.0, "forward_s": 1.0, "backward_s": 1.0, "kernels": 4, "unique_kernels": 3}
    rows = [{"world_size": n, "blocks": 1, "inductor": measured, "commfuse": {**measured, "total_s": 1.0 * n}} for n in (2, 8)]
    table = compile_time.render({"results": rows, "world_size": [2, 8], "schedule": "ring"}).splitlines()
    assert [line.split()[:4] for line in table[-4:]] == [["2", "1", "inductor", "2.0"], ["2", "1", "commfuse", "2.0"], ["8", "1", "inductor", "2.0"], ["8", "1", "commfuse", "8.0"]]
    assert table[-1].split()[5] == "4.00"  # vs inductor at its own group size


def test_step_time_rate_parsing():
    assert step_time.rate_bytes_per_second("400mbit") == 50e6
    assert step_time.rate_bytes_per_second("1gbit") == 125e6
    assert step_time.rate_bytes_per_second("10mbps") == 10e6


@pytest.mark.slow
def test_moe_memory_smoke(tmp_path):
    results = _run(moe_memory.main, ["--quick"], tmp_path / "moe_memory.json")
    assert results["benchmark"] == "moe_memory" and set(results["variants"]) == {"inductor", "commfuse"}
    for variant, ranks in results["variants"].items():
        assert len(ranks) == 2 and all(rank["peak_increase"] >= 0 for rank in ranks)
    assert [s["pattern"] for s in results["variants"]["commfuse"][0]["sites"] if s["action"] == "rewritten"] == ["moe_ep", "moe_ep"]


def test_peak_memory_model():
    sizes = {"S": 1024, "K": 8, "H": 256}
    full = 1024 * 256 * 4
    assert peak_memory.analytic_bytes("off", sizes, 2, None)["product_held"] == full
    assert peak_memory.analytic_bytes("ring", sizes, 2, None)["product_held"] == 3 * full // 2
    assert peak_memory.analytic_bytes("ring", sizes, 2, 4)["product_held"] == 3 * full // 8


@pytest.mark.parametrize("module", [step_time, model_step, compile_time, peak_memory, moe_memory], ids=lambda m: m.__name__)
def test_help(module, capsys):
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert "--json" in capsys.readouterr().out


def test_reorder_peer_runs_its_passes():
    """step_time's ``inductor-reorder`` setting changes what Inductor generates (the flag alone
    runs no pass in torch 2.13): in the MLP's backward the weight-gradient matmul moves between
    the reduce-scatter's start and its wait. Single process, fake group; read from the code."""
    import torch
    from _common import schedule_of
    from torch._inductor.utils import run_and_get_code

    import commfuse_compile

    codes = {}
    with commfuse_compile.fake_world(2):
        inputs = [torch.randn(64, 128, requires_grad=True), torch.randn(128, 256, requires_grad=True), torch.randn(256, 128, requires_grad=True)]
        for name, flag in (("inductor", {}), ("inductor-reorder", step_time.REORDER_PEER)):
            torch._dynamo.reset()
            with torch._inductor.config.patch({**flag, "fx_graph_cache": False}):
                compiled = torch.compile(sequence_parallel_mlp, backend="inductor", options=flag or None)
                _, codes[name] = run_and_get_code(lambda: compiled(*inputs).sum().backward())
    torch._dynamo.reset()
    plain, reordered = (schedule_of(codes[name][1]) for name in ("inductor", "inductor-reorder"))
    assert plain != reordered, plain
    between = reordered[reordered.index("reduce_scatter_tensor") : reordered.index("wait_tensor", reordered.index("reduce_scatter_tensor"))]
    assert "mm" in between, reordered
