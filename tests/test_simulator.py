"""Simulator timelines by hand, Chrome traces, and benchmarks/simulate_paper.py — single process."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from commfuse_compile.cost_model import Matmul, Workload, estimate
from commfuse_compile.profiles import HardwareProfile
from commfuse_compile.simulator import Timeline
from commfuse_compile.trace import LANES, chrome_trace, write_chrome_trace

# Round numbers, so that times can be worked out by hand: 1 GFLOP/s, 1 GB/s, 1 ms latency.
ROUND = HardwareProfile(
    name="round", source="test", flops_16bit=1e9, flops_32bit=1e9, half_efficiency_dim=1e-9,
    matmul_overhead=0.0, link_bandwidth=1e9, link_latency=1e-3, duplex=True, overlap_slowdown=1.0,
)


def work(kind="all_gather_matmul", n=4, rows=400, chunk_bytes=4_000_000):
    return Workload(kind, n, (Matmul(rows, 1000, 1000),), chunk_bytes, torch.float32)


# ---- simulator ---------------------------------------------------------------------------


def test_two_lanes_with_dependencies():
    t = Timeline()
    a = t.add("a", "x", 2.0)
    t.add("b", "y", 1.0, (a,))  # 2..3
    c = t.add("c", "x", 3.0)  # lane x free at 2: 2..5
    d = t.add("d", "y", 1.0, (c,))  # waits for c, not for lane y (free at 3): 5..6
    assert t.run() == 6.0
    assert [(e.start, e.end) for e in t.events] == [(0, 2), (2, 3), (2, 5), (5, 6)]
    assert t.events[d].deps == (c,)


def test_a_lane_runs_in_program_order():
    # The independent "free" event queues behind "waits" on lane y although it could run at 0.
    t = Timeline()
    slow = t.add("slow", "x", 5.0)
    t.add("waits", "y", 1.0, (slow,))
    t.add("free", "y", 1.0)
    assert t.run() == 7.0
    assert (t.events[2].start, t.events[2].end) == (6.0, 7.0)


def test_an_event_waits_for_its_latest_dependency():
    t = Timeline()
    deps = (t.add("a", "x", 1.0), t.add("b", "y", 4.0), None)  # None deps are dropped
    t.add("c", "z", 1.0, deps)
    assert t.run() == 5.0 and t.events[2].deps == (0, 1)


def test_busy_sums_lanes_by_prefix_and_empty_timeline():
    t = Timeline()
    t.add("s", "link+", 2.0)
    t.add("r", "link-", 3.0)
    t.add("m", "compute", 1.0)
    assert t.run() == 3.0
    assert (t.busy("link"), t.busy("link+"), t.busy("compute"), t.busy("collective")) == (5.0, 2.0, 1.0, 0.0)
    assert Timeline().run() == 0.0


def test_reduce_scatter_slicing_leaves_the_last_slice_exposed():
    # 4 slices of 0.2 s each; the last slice's reduce-scatter, 3 × (1 ms + 1 MB / 1 GB/s), follows.
    e = estimate(work("matmul_reduce_scatter"), ROUND, "slicing", 4)
    assert e.seconds == pytest.approx(0.8 + 0.006)
    assert e.exposed_comm == pytest.approx(0.006)


def test_overlap_slowdown_stretches_overlapped_compute_only():
    slow = HardwareProfile(**{**ROUND.__dict__, "overlap_slowdown": 1.5})
    assert estimate(work(), slow, "ring", 1).seconds == pytest.approx(4 * 0.2 * 1.5)
    assert estimate(work(), slow, "vanilla").seconds == pytest.approx(0.8 + 3 * 0.005)


# ---- chrome traces -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def estimates():
    return [estimate(work(), ROUND, "vanilla"), estimate(work(), ROUND, "ring", 1),
            estimate(work(rows=8, chunk_bytes=40_000_000), ROUND, "bidirectional", 1)]


def test_chrome_trace_has_one_complete_event_per_timeline_event(estimates):
    trace = json.loads(json.dumps(chrome_trace(estimates, "t")))
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"]["title"] == "t"
    events = trace["traceEvents"]
    for pid, est in enumerate(estimates, start=1):
        xs = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        assert len(xs) == len(est.timeline.events)
        for x, ev in zip(xs, est.timeline.events):
            assert (x["name"], x["cat"]) == (ev.name, ev.lane)
            assert x["ts"] == pytest.approx(ev.start * 1e6) and x["dur"] == pytest.approx((ev.end - ev.start) * 1e6)
            assert x["args"]["total_ms"] == pytest.approx(est.seconds * 1e3)
            assert x["args"]["exposed_comm_ms"] == pytest.approx(est.exposed_comm * 1e3)
        assert [e["args"]["name"] for e in events if e["pid"] == pid and e["name"] == "process_name"] == [est.label]
        threads = {e["tid"]: e["args"]["name"] for e in events if e["pid"] == pid and e["name"] == "thread_name"}
        assert sorted(threads.values()) == sorted({ev.lane for ev in est.timeline.events})
        assert all(LANES.index(lane) + 1 == tid for tid, lane in threads.items())  # same row in every process
        assert {x["tid"] for x in xs} == set(threads)


def test_all_four_lanes_and_an_unknown_one_get_threads(estimates, tmp_path):
    t = Timeline()
    t.add("other", "disk", 1.0)
    t.run()
    extra = type(estimates[0])("custom", 1, 1.0, 0.0, t)
    path = os.path.join(tmp_path, "trace.json")
    write_chrome_trace(path, [*estimates, extra])
    with open(path) as f:
        trace = json.load(f)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert set(threads.values()) == {*LANES, "disk"}
    assert threads[(4, len(LANES) + 1)] == "disk"


# ---- benchmarks/simulate_paper.py --------------------------------------------------------


@pytest.fixture(scope="module")
def paper():
    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "simulate_paper.py")
    spec = importlib.util.spec_from_file_location("simulate_paper", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_table1_calibration_and_ring_beats_slicing(paper):
    rows = {r.schedule: r for r in paper.table1_rows()}
    vanilla = rows["vanilla"]
    assert vanilla.ms == pytest.approx(122.3, rel=1e-6)  # by construction
    assert vanilla.exposed_ms == pytest.approx(43.8, rel=1e-6)
    slicing = [r for r in rows.values() if r.schedule.startswith("slicing")]
    assert slicing and all(rows["ring(m=1)"].exposed_ms < r.exposed_ms for r in slicing)
    assert rows["ring(m=1)"].ms < min(r.ms for r in slicing)


def test_layer_timeline_is_the_two_matches_in_sequence(paper):
    works = paper.mlp_works(paper.BATCH * 1024)
    profile = paper.calibrate(works)
    for schedule, m in [("vanilla", 1), ("slicing", 4), ("ring", 1), ("bidirectional", 1)]:
        layer = paper.mlp_estimate(works, profile, schedule, m)
        assert layer.seconds == pytest.approx(sum(estimate(w, profile, schedule, m).seconds for w in works))


def test_calibrated_times_do_not_depend_on_ffn_width_or_dtype(paper):
    def times(**kw):
        works = paper.mlp_works(paper.BATCH * paper.SEQ, **kw)
        return [t for r in paper.table1_rows(paper.calibrate(works), works) for t in (r.ms, r.exposed_ms)]

    base = times()
    for other in (times(ffn=paper.HIDDEN), times(dtype=torch.float32)):
        assert other == pytest.approx(base, rel=1e-9)
