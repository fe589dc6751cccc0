"""``auto``'s measured profile (``commfuse_compile.calibrate``) on gloo ranks: measured at the
first compile by every rank at once, agreed (every rank plans with the same numbers), cached on
disk and reused; a named profile still wins; the fake group keeps the named default."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import fake_world

import commfuse_compile
from commfuse_compile import calibrate

FIELDS = ("flops_32bit", "flops_16bit", "half_efficiency_dim", "matmul_overhead", "link_bandwidth", "link_latency", "collective_latency", "duplex", "overlap_slowdown", "step_overhead")


def measure_twice(cache_dir: str, private: bool) -> dict:
    """Measure (cache in ``cache_dir``, one per rank if ``private``), forget, then load."""
    import torch.distributed as dist

    os.environ["COMMFUSE_CACHE_DIR"] = os.path.join(cache_dir, str(dist.get_rank()) if private else "shared")
    calibrate._measured.clear()
    first = calibrate.measured_profile()
    calibrate._measured.clear()
    if private and dist.get_rank() == 1:  # rank 1 lost its cache: everyone measures again
        calibrate.cache_path(calibrate.cache_key()).unlink()
    second = calibrate.measured_profile()
    calibrate._measured.clear()
    return {"first": calibrate.as_option(first), "second": calibrate.as_option(second)}


@pytest.mark.parametrize("private", [False, True], ids=["shared-cache", "one-rank-without-cache"])
def test_measured_once_agreed_and_cached(ranks, tmp_path, private):
    results = ranks.run(measure_twice, str(tmp_path), private)
    first, second = results[0]["first"], results[0]["second"]
    assert all(r == results[0] for r in results), "every rank plans with the same numbers"
    assert first["source"] == "measured at the first compile"
    assert all(isinstance(first[k], (int, float, bool)) for k in FIELDS)
    assert first["link_bandwidth"] > 1e6 and first["flops_32bit"] > 1e8 and first["overlap_slowdown"] >= 1.0
    assert 0.0 <= first["step_overhead"] < 1.0  # (seconds: a ring step's host share)
    if private:  # one rank without the cache: measured again by all
        assert second["source"] == "measured at the first compile"
    else:  # every rank has it: reused as it was agreed
        assert second["source"].startswith("measured earlier, cached in")
        assert {k: second[k] for k in FIELDS} == {k: first[k] for k in FIELDS}


def compile_with(options: dict | None, cache_dir: str) -> list[str]:
    """Compile an all-gather → matmul with the backend; the profile each site was planned with."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    os.environ["COMMFUSE_CACHE_DIR"] = cache_dir
    calibrate._measured.clear()
    torch._dynamo.reset()

    def layer(x, w):
        return funcol.all_gather_tensor(x, 0, dist.group.WORLD) @ w

    before = len(commfuse_compile.reports())
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(layer, backend="commfuse", options=options)(torch.randn(64, 128), torch.randn(128, 256))
    return [site.profile for report in commfuse_compile.reports()[before:] for site in report.sites]


def test_auto_plans_with_the_measured_profile_and_a_named_one_wins(ranks, tmp_path):
    for profiles in ranks.run(compile_with, None, str(tmp_path)):
        assert profiles == [f"measured({ranks.world_size} ranks)"], profiles
    for profiles in ranks.run(compile_with, {"profile": "cpu-gloo"}, str(tmp_path)):
        assert profiles == ["cpu-gloo"], profiles


def test_the_fake_group_and_fixed_schedules_measure_nothing():
    with fake_world(4):
        assert calibrate.measured_profile() is None
    from commfuse_compile.backend import _with_measured_profile
    from commfuse_compile.options import CommfuseOptions

    ring = CommfuseOptions.from_user({"schedule": "ring"})
    assert _with_measured_profile(ring) is ring  # (nothing to decide: no collectives run)


def test_cache_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("COMMFUSE_CACHE_DIR", str(tmp_path))
    path = calibrate.cache_path("host|cpu|gloo|ranks=[0, 1]|torch=2.13.0")
    assert path.parent == tmp_path and path.name.startswith("profile-") and path.suffix == ".json"
    assert calibrate.cache_path("host|cpu|gloo|ranks=[0, 1, 2]|torch=2.13.0") != path


def test_ranks_agree_on_the_slowest_rate_the_largest_cost_and_the_typical_slowdown():
    fields = calibrate.FIELDS
    assert set(fields) == set(FIELDS)
    rows = []
    for rank, slowdown in enumerate([1.1, 2.5, 1.2, 1.0]):  # (one rank's window was unlucky)
        values = {k: 10.0 + rank for k in fields} | {"overlap_slowdown": slowdown, "step_overhead": 1e-3 * (rank + 1)}
        rows.append([values[k] for k in fields])
    agreed = calibrate.agree(torch.tensor(rows, dtype=torch.float64))
    assert agreed["link_bandwidth"] == 10.0 and agreed["flops_32bit"] == 10.0  # the slowest rank's
    assert agreed["link_latency"] == 13.0  # the largest
    assert agreed["overlap_slowdown"] == pytest.approx(1.15)  # the median, not the worst window
    assert agreed["step_overhead"] == pytest.approx(2.5e-3)
    assert calibrate.agree(torch.tensor(rows[:3], dtype=torch.float64))["overlap_slowdown"] == pytest.approx(1.2)


def test_a_profile_measured_another_way_is_measured_again(monkeypatch):
    with fake_world(2):
        key = calibrate.cache_key()
        assert key.endswith(f"|method={calibrate.METHOD}")
        monkeypatch.setattr(calibrate, "METHOD", calibrate.METHOD + 1)
        assert calibrate.cache_key() != key


def test_a_dtype_without_fast_kernels_is_rated_by_its_probe():
    # The large matmul is timed only where the probe's rate says it is quick: 1024 x 1024 x 512
    # at 50 GFLOP/s takes about 21 ms; bf16 on a CPU without bf16 kernels (0.5 GFLOP/s) 2 s,
    # six of which were most of the first compile's measuring.
    assert calibrate.time_large_matmul(50e9, 1024)
    assert not calibrate.time_large_matmul(0.5e9, 1024)
    assert calibrate.time_large_matmul(0.5e9, 1024, budget_s=3.0)
