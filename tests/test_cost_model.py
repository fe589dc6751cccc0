"""Cost model, profiles, ``auto`` and the schedule options — single process, no communication."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from conftest import fake_world

from commfuse_compile.cost_model import Matmul, Workload, bidirectional_pays, candidates, choose, estimate
from commfuse_compile.options import CommfuseOptions
from commfuse_compile.passes import run_pipeline
from commfuse_compile.profiles import BUILTIN, HardwareProfile, resolve_profile
from commfuse_compile.report import new_report
from graphs import copy_graph, post_grad_graphs

# A profile with round numbers so that schedules can be timed by hand below: 1 GFLOP/s at
# full efficiency, no overheads, 1 GB/s links, 1 ms latency.
ROUND = HardwareProfile(
    name="round", source="test", flops_16bit=1e9, flops_32bit=1e9, half_efficiency_dim=1e-9,
    matmul_overhead=0.0, link_bandwidth=1e9, link_latency=1e-3, duplex=True, overlap_slowdown=1.0,
)


def work(kind="all_gather_matmul", n=4, rows=400, k=1000, cols=1000, chunk_bytes=4_000_000):
    return Workload(kind, n, (Matmul(rows, k, cols),), chunk_bytes, torch.float32)


def test_vanilla_is_collective_plus_matmul():
    # all-gather: 3 steps of (1 ms + 4 MB / 1 GB/s = 4 ms); matmul 2·400·1000·1000 / 1e9 = 0.8 s.
    e = estimate(work(), ROUND, "vanilla")
    assert e.seconds == pytest.approx(3 * 0.005 + 0.8)
    assert e.exposed_comm == pytest.approx(0.015)


def test_ring_hides_everything_when_transfers_are_shorter_than_matmuls():
    # Each of the 4 steps computes a quarter (0.2 s) while a 5 ms transfer runs: nothing waits.
    e = estimate(work(), ROUND, "ring", 1)
    assert e.seconds == pytest.approx(0.8)
    assert e.exposed_comm == pytest.approx(0.0)


def test_ring_is_bound_by_links_when_transfers_dominate():
    # 40 MB chunks: transfers take 41 ms; the matmul of a 2-row chunk takes 4 ms. Three
    # transfers in a row, then the last chunk's matmul.
    w = work(rows=8, chunk_bytes=40_000_000)
    assert estimate(w, ROUND, "ring", 1).seconds == pytest.approx(3 * 0.041 + 0.004)
    # Bidirectional: half of each chunk each way, both links at once: 3 × 21 ms, then the
    # last step's two 1-row halves.
    assert estimate(w, ROUND, "bidirectional", 1).seconds == pytest.approx(3 * 0.021 + 0.004)


def test_all_to_all_hides_all_but_the_first_and_last_block():
    """One matmul before (0.8 s whole) and one after: vanilla computes, exchanges 3 blocks of 5 ms
    each, computes; the pairwise steps compute block r + 1 first (0.2 s) and the last arrived
    block after the last step (0.2 s), everything else overlapping its step's transfer."""
    from commfuse_compile.passes.all_to_all import timelines

    a2a = Workload("all_to_all", 4, (Matmul(400, 1000, 1000), Matmul(400, 1000, 1000)), 4_000_000, torch.float32, before=1, timelines=timelines)
    assert estimate(a2a, ROUND, "vanilla").seconds == pytest.approx(0.8 + 3 * 0.005 + 0.8)
    ring = estimate(a2a, ROUND, "ring", 1)
    assert ring.seconds == pytest.approx(8 * 0.2)  # 4 blocks before, 4 after, one lane
    assert ring.exposed_comm == pytest.approx(0.0)
    after_only = Workload("all_to_all", 4, (Matmul(400, 1000, 1000),), 4_000_000, torch.float32, timelines=timelines)
    assert estimate(after_only, ROUND, "ring", 1).seconds == pytest.approx(4 * 0.2)


def test_moe_pipeline_exposes_only_the_last_combine_step():
    """Experts of 0.8 s on every token, 5 ms per block transfer: vanilla dispatches (15 ms),
    computes, combines (15 ms); the pipeline computes the own tokens first (0.2 s) while the
    first tokens arrive, and only the last combine step (one block) waits at the end."""
    from commfuse_compile.passes.moe_ep import timelines

    moe = Workload("moe_ep", 4, (Matmul(400, 1000, 1000),), 4_000_000, torch.float32, timelines=timelines)
    assert estimate(moe, ROUND, "vanilla").seconds == pytest.approx(0.015 + 0.8 + 0.015)
    pipeline = estimate(moe, ROUND, "ring", 1)
    assert pipeline.seconds == pytest.approx(0.8 + 0.005)
    assert pipeline.exposed_comm == pytest.approx(0.005)
    # transfers longer than a block's experts: the links set the pace
    slow = Workload("moe_ep", 4, (Matmul(400, 1000, 1000),), 400_000_000, torch.float32, timelines=timelines)
    assert estimate(slow, ROUND, "ring", 1).seconds > 3 * 0.401


def test_step_overhead_takes_compute_time_at_every_step():
    """The host's share of a ring step is on the compute lane: three sending steps of the
    all-gather ring add 3 × 50 ms to its 0.8 s of (hidden-transfer) matmuls; the all-to-all's
    three pairwise steps add the same, and each of slicing's collectives its N - 1 messages'.
    A tiny matmul the ring would win on (vanilla 15 ms + 8 µs) is then left to the plain
    collective."""
    import dataclasses

    from commfuse_compile.passes.all_to_all import timelines

    costly = dataclasses.replace(ROUND, step_overhead=0.05)
    assert estimate(work(), costly, "ring", 1).seconds == pytest.approx(0.8 + 3 * 0.05)
    a2a = Workload("all_to_all", 4, (Matmul(400, 1000, 1000), Matmul(400, 1000, 1000)), 4_000_000, torch.float32, before=1, timelines=timelines)
    assert estimate(a2a, costly, "ring").seconds == pytest.approx(estimate(a2a, ROUND, "ring").seconds + 3 * 0.05)
    # Slicing's K sliced collectives run beside compute too: N - 1 messages each (the first
    # slice's 9 ms gather now runs while the compute lane pays for them).
    assert estimate(work(), costly, "slicing", 2).seconds == pytest.approx(0.8 + 2 * 3 * 0.05)
    tiny = work(rows=2, k=2, cols=1000)
    assert choose([estimate(tiny, ROUND, "ring", 1)], estimate(tiny, ROUND, "vanilla"), 1.0) is not None
    assert choose([estimate(tiny, costly, "ring", 1)], estimate(tiny, costly, "vanilla"), 1.0) is None


def test_reduce_scatter_ring_ends_on_its_own_chunk():
    # Flash-RS: the matmul of step 0 (0.2 s) precedes the first transfer; 3 transfers of 5 ms
    # each overlap the next matmul; the last step adds the last received partial.
    e = estimate(work("matmul_reduce_scatter"), ROUND, "ring", 1)
    assert e.seconds == pytest.approx(0.8)


def test_slicing_leaves_one_slice_of_communication_exposed():
    # 4 slices: gather of slice 0 (3 × (1 ms + 1 ms) = 6 ms) is exposed, the rest hides.
    e = estimate(work(), ROUND, "slicing", 4)
    assert e.seconds == pytest.approx(0.006 + 0.8)
    assert e.exposed_comm == pytest.approx(0.006)


def test_bidirectional_with_two_ranks_is_the_ring_with_halves():
    # With 2 ranks both directions reach the same peer over the same link: no second link, so
    # it times exactly like the one-way ring with 2 pieces per chunk.
    w = work(n=2, rows=8, chunk_bytes=40_000_000)
    assert estimate(w, ROUND, "bidirectional", 1).seconds == pytest.approx(estimate(w, ROUND, "ring", 2).seconds)
    assert estimate(work(n=4, rows=8, chunk_bytes=40_000_000), ROUND, "bidirectional", 1).seconds < estimate(
        work(n=4, rows=8, chunk_bytes=40_000_000), ROUND, "ring", 2).seconds


def test_choose_never_picks_something_slower_than_vanilla():
    w = work(rows=8, k=8, cols=8, chunk_bytes=256)  # tiny: every extra matmul / message costs more than it hides
    h100 = BUILTIN["h100-nvlink"]
    vanilla = estimate(w, h100, "vanilla")
    estimates = [estimate(w, h100, s, m) for s, m in candidates("auto", None)]
    assert all(e.seconds > vanilla.seconds for e in estimates)
    assert choose(estimates, vanilla, min_speedup=0.1) is None  # even with a lax threshold
    assert choose(estimates, vanilla, min_speedup=1.0) is None
    assert choose([estimate(work(), h100, "ring", 1)], estimate(work(), h100, "vanilla"), 1.0) is not None


def test_candidates():
    assert candidates("ring", None) == [("ring", 1)]
    assert candidates("slicing", None) == [("slicing", 4)]
    assert candidates("bidirectional", 3) == [("bidirectional", 3)]
    assert {s for s, _ in candidates("auto", None)} == {"ring", "bidirectional", "slicing"}
    assert set(candidates("auto", 2)) == {("ring", 2), ("bidirectional", 2), ("slicing", 2)}
    assert {s for s, _ in candidates("auto", None, bidirectional=False)} == {"ring", "slicing"}
    assert candidates("bidirectional", None, bidirectional=False) == [("bidirectional", 1)]  # (asked for: kept)


def test_bidirectional_is_considered_where_it_can_pay():
    one_link = dataclasses.replace(ROUND, duplex=False)
    assert bidirectional_pays(ROUND, 4) and bidirectional_pays(ROUND, 2)
    assert bidirectional_pays(one_link, 2)  # (both halves to the one peer at once)
    assert not bidirectional_pays(one_link, 4)  # (the two neighbours share the one link)


# ---- options and profiles: errors name the option ------------------------------------------


@pytest.mark.parametrize(
    "options,message",
    [
        ({"schedule": "fast"}, "'schedule' must be one of 'auto', 'ring', 'bidirectional', 'slicing', 'off'"),
        ({"chunks_per_rank": 0}, "'chunks_per_rank' must be an int >= 1"),
        ({"chunks_per_rank": 2.5}, "'chunks_per_rank' must be an int >= 1"),
        ({"chunks_per_rank": True}, "'chunks_per_rank' must be an int >= 1"),
        ({"schedule": "off", "chunks_per_rank": 2}, "'chunks_per_rank' has no effect with schedule='off'"),
        ({"min_speedup": 0}, "'min_speedup' for all_gather_matmul must be a finite number > 0"),
        ({"min_speedup": float("nan")}, "'min_speedup' for all_gather_matmul must be a finite number > 0, got nan"),
        ({"min_speedup": float("inf")}, "'min_speedup' for all_gather_matmul must be a finite number > 0, got inf"),
        ({"min_speedup": {"matmul_reduce_scatter": float("nan")}}, "'min_speedup' for matmul_reduce_scatter must be a finite"),
        ({"min_speedup": {"all_gather": 2}}, "'min_speedup': unknown pattern"),
        ({"profile": "tpu"}, "'profile': unknown profile 'tpu'; built-in: a100-nvlink, cpu-gloo"),
        ({"profile": {"base": "h100-nvlink", "bandwidth": 1}}, "'profile': unknown field.*'bandwidth'"),
        ({"profile": {"base": "h100-nvlink", "link_bandwidth": -1}}, "'profile': field 'link_bandwidth' must be a finite number > 0"),
        ({"profile": {"base": "h100-nvlink", "link_bandwidth": float("nan")}}, "field 'link_bandwidth' must be a finite number > 0, got nan"),
        ({"profile": {"base": "h100-nvlink", "link_bandwidth": float("inf")}}, "field 'link_bandwidth' must be a finite number > 0, got inf"),
        ({"profile": {"base": "h100-nvlink", "flops_16bit": float("nan")}}, "field 'flops_16bit' must be a finite number > 0"),
        ({"profile": {"base": "h100-nvlink", "link_latency": float("nan")}}, "field 'link_latency' must be a finite number >= 0"),
        ({"profile": {"base": "h100-nvlink", "link_latency": -1e-6}}, "field 'link_latency' must be a finite number >= 0"),
        ({"profile": {"base": "h100-nvlink", "overlap_slowdown": 0.5}}, "field 'overlap_slowdown' must be a finite number >= 1"),
        ({"profile": {"base": "h100-nvlink", "duplex": "no"}}, "field 'duplex' must be True or False, got 'no'"),
        ({"profile": {"base": "h100-nvlink", "duplex": 1}}, "field 'duplex' must be True or False"),
        ({"profile": {"base": "h100-nvlink", "name": 7}}, "field 'name' must be a string"),
        ({"profile": {"base": 5}}, "'base' must be a built-in profile name"),
        ({"profile": {"flops_16bit": 1e12}}, "'profile': missing field"),
        ({"profile": 3}, "'profile' must be a profile name or a dict"),
        ({"mode": "fast"}, "'mode' must be one of 'default', 'reduce-overhead', 'max-autotune'"),
        ({"mode": "lite"}, "'lite' turns off Inductor's post-grad passes"),
    ],
)
def test_invalid_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        CommfuseOptions.from_user(options)


def test_options_built_directly_are_checked_too():
    with pytest.raises(ValueError, match="'min_speedup' for all_gather_matmul must be a finite number"):
        CommfuseOptions(min_speedup=float("nan"))
    with pytest.raises(ValueError, match="field 'link_bandwidth' must be a finite number > 0"):
        HardwareProfile(**{**vars(BUILTIN["h100-nvlink"]), "link_bandwidth": float("inf")})


def test_idealised_profile_fields_may_be_zero():
    p = resolve_profile({"base": "h100-nvlink", "link_latency": 0, "matmul_overhead": 0.0, "half_efficiency_dim": 0})
    assert (p.link_latency, p.matmul_overhead, p.half_efficiency_dim) == (0, 0.0, 0)
    assert resolve_profile({"base": "h100-nvlink", "duplex": False}).duplex is False


def test_profile_dict_overrides_a_builtin():
    p = resolve_profile({"base": "h100-nvlink", "link_bandwidth": 50e9})
    assert p.link_bandwidth == 50e9 and p.flops_16bit == BUILTIN["h100-nvlink"].flops_16bit
    assert resolve_profile(None, "cpu").name == "cpu-gloo" and resolve_profile(None, "cuda").name == "h100-nvlink"


# ---- auto on real graphs (fake process group, world size 4) ---------------------------------

WORLD = 4


def mlp_graphs(rows: int, hidden: int, ffn: int, dtype=torch.float32):
    def mlp(x, w1, w2):
        h = funcol.all_gather_tensor(x, 0, torch.distributed.group.WORLD)
        y = torch.relu(h @ w1) @ w2
        return funcol.reduce_scatter_tensor(y, "sum", 0, torch.distributed.group.WORLD)

    x = torch.randn(rows // WORLD, hidden, dtype=dtype, requires_grad=True)
    w1 = torch.randn(hidden, ffn, dtype=dtype, requires_grad=True)
    w2 = torch.randn(ffn, hidden, dtype=dtype, requires_grad=True)
    return post_grad_graphs(mlp, x, w1, w2)


def plan_as(graph, kind: str, rank: int, **options):
    sites = run_pipeline(copy_graph(graph), CommfuseOptions.from_user(options), kind, new_report({}), rank_of=lambda _: rank)
    return sites


@pytest.fixture(scope="module")
def world():
    with fake_world(WORLD) as group:
        yield group


def test_auto_leaves_a_tiny_matmul_alone_and_decomposes_a_large_one(world):
    tiny = mlp_graphs(8, 16, 32)["forward"]
    large = mlp_graphs(2048, 1024, 4096)["forward"]
    for site in plan_as(tiny, "forward", 0, profile="h100-nvlink"):
        assert site.decision == "skip" and "nothing beats vanilla" in site.reason, site.reason
        assert site.estimates["vanilla"] < min(v for k, v in site.estimates.items() if k != "vanilla")
    for site in plan_as(large, "forward", 0, profile="l40s-pcie"):  # a GPU whose links are slow
        assert site.decision == "rewrite", site.reason
        chosen = f"{site.schedule}(m={site.chunks_per_rank})"
        assert site.estimates[chosen] == min(site.estimates.values()) < site.estimates["vanilla"]
        assert "auto (l40s-pcie)" in site.reason


def test_auto_plans_are_the_same_on_every_rank(world):
    graphs = mlp_graphs(2048, 1024, 4096)
    for kind, graph in graphs.items():
        plans = [
            [(s.pattern, s.decision, s.schedule, s.chunks_per_rank, s.reason, s.estimates) for s in plan_as(graph, kind, r, profile="a100-nvlink")]
            for r in range(WORLD)
        ]
        assert all(p == plans[0] for p in plans), kind


def test_schedule_off_matches_and_estimates_but_rewrites_nothing(world):
    graph = mlp_graphs(8, 16, 32)["forward"]
    sites = plan_as(graph, "forward", 0, schedule="off")
    assert [s.decision for s in sites] == ["skip", "skip"]
    assert all("schedule='off'" in s.reason and "vanilla" in s.estimates for s in sites)


def test_min_speedup_per_pattern(world):
    large = mlp_graphs(2048, 1024, 4096)["forward"]
    sites = plan_as(large, "forward", 0, profile="l40s-pcie", min_speedup={"matmul_reduce_scatter": 1000.0})
    assert [s.decision for s in sites] == ["rewrite", "skip"]
    assert "min_speedup=1000.0" in sites[1].reason


def test_chunks_per_rank_that_does_not_divide_is_a_recorded_skip(world):
    graph = mlp_graphs(8, 16, 32)["forward"]  # 8 rows over 4 ranks: 2 per rank
    sites = plan_as(graph, "forward", 0, schedule="ring", chunks_per_rank=3)
    assert all(s.decision == "skip" and "chunks_per_rank=3" in s.reason for s in sites)


# ---- uneven shards: the plan reads only what every rank of the group shares ---------------------


def uneven_mlp_graphs(ffn_shard: int):
    """The MLP as the rank holding ``ffn_shard`` columns of W1 (rows of W2) traces it: an FFN
    of 153 over 4 ranks is 39, 38, 38, 38 (torch.tensor_split); everything else is alike."""
    return mlp_graphs(2048, 1024, ffn_shard)


@pytest.mark.parametrize("profile", ["cpu-gloo", "l40s-pcie", "h100-nvlink"])
def test_uneven_shards_get_the_same_plan_on_every_rank(world, profile):
    """With uneven shards the ranks' matmuls differ in one dim; a plan that read it chose
    bidirectional on one rank and ring on another (and the run aborted in gloo)."""
    by_shard = {ffn: uneven_mlp_graphs(ffn) for ffn in (39, 38)}
    for kind in ("forward", "backward"):
        plans = {
            ffn: [(s.pattern, s.decision, s.schedule, s.chunks_per_rank, s.estimates) for s in plan_as(graphs[kind], kind, rank, profile=profile)]
            for (ffn, graphs), rank in zip(by_shard.items(), (0, 3))
        }
        assert plans[39] == plans[38], (kind, plans)
        assert plans[39] and all(estimates for *_, estimates in plans[39])


def test_plan_check_payload_is_the_same_on_every_rank(world):
    """The plan the ranks compare at the first call (``check_plan``) leaves out what differs
    between ranks when nothing is wrong (local shapes, the rank itself)."""
    import json

    payloads = []
    for ffn, rank in ((39, 0), (38, 3)):
        graph = copy_graph(uneven_mlp_graphs(ffn)["forward"])
        run_pipeline(graph, CommfuseOptions(schedule="ring"), "forward", new_report({}), rank_of=lambda _: rank)
        (check,) = [n for n in graph.nodes if n.target is torch.ops.commfuse.check_plan.default]
        assert next(n for n in graph.nodes if n.op != "placeholder") is check  # first, before any ring step
        plan = json.loads(check.args[0])
        assert check.args[1] == world.group_name and len(plan.pop("token")) == 32
        payloads.append(plan)
    assert payloads[0] == payloads[1]
    assert [(s["kind"], s["decision"], s["schedule"]) for s in payloads[0]["sites"]] == [
        ("all_gather_matmul", "rewrite", "ring"),
        ("matmul_reduce_scatter", "rewrite", "ring"),
    ]


def test_auto_says_why_it_leaves_the_bidirectional_ring_out(world):
    forward = mlp_graphs(256, 256, 512)["forward"]
    one_link = plan_as(forward, "forward", 0, profile={"base": "cpu-gloo", "duplex": False})
    assert one_link, "the MLP's forward has sites"
    for site in one_link:
        assert not any(label.startswith("bidirectional") for label in site.estimates), site.estimates
        assert any("bidirectional not considered" in note and "duplex=False" in note for note in site.notes), site.notes
    for site in plan_as(forward, "forward", 0, profile="cpu-gloo"):
        assert any(label.startswith("bidirectional") for label in site.estimates), site.estimates
