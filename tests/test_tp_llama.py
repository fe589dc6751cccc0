"""A Llama-style block under a torchtitan-style TP + SP plan, trained for several SGD steps
compiled with commfuse and eagerly (DTensor), at world sizes 2 and 4 and on a 2-D mesh.

Every schedule at tp = 2 and tp = 4 (slicing with 2 slices), fusion on (the default): the
SwiGLU after the w1/w3 gather and its gradient after the backward gather run inside the ring
steps, and attention is split by query rows before the wo reduce-scatter. The ring is compiled
by Inductor at tp = 2 (a compile takes a minute here) and run op by op at tp = 4; the other schedules and the 2-D mesh (dp 2 × tp 2, batch
1, the one-way ring with m = 2) run their rewritten graphs op by op (``codegen=False``)."""

from __future__ import annotations

import pytest
from llama import train_llama_block

pytestmark = pytest.mark.slow

STEPS = 3
# fp32, max |compiled - eager| / max |eager| per tensor. Inductor's fusions and the ring's
# summation order both reorder sums: plain Inductor (no commfuse) measured ~1e-6 here too.
TOL = 1e-5

# Per graph: q/k/v share one all-gather, w1/w3 another; wo and w2 each feed a reduce-scatter.
# Backward: the gathered output grads of wo / w2, and the input grads of q+k+v / w1+w3 (sums of
# matmuls) reduce-scattered. Every one must be rewritten: the count is exact on purpose.
EXPECTED = sorted(
    [(g, "all_gather_matmul") for g in ("forward", "backward") for _ in range(2)]
    + [(g, "matmul_reduce_scatter") for g in ("forward", "backward") for _ in range(2)]
)


def check(result: dict, tp_size: int, tol: float = TOL) -> None:
    sites = result["sites"]
    assert sorted((g, p) for g, p, *_ in sites) == EXPECTED, sites
    for graph, pattern, action, group, size, reason in sites:
        assert action == "rewritten", (graph, pattern, reason)
        assert (group, size) == (result["tp_group"], tp_size)
    bad = {k: v for k, v in result["diffs"].items() if v > tol}
    assert not bad, bad


SCHEDULES = [{"schedule": "ring"}, {"schedule": "bidirectional", "codegen": False}, {"schedule": "slicing", "chunks_per_rank": 2, "codegen": False}]
# (graph, pattern) -> an op that site's steps must compute (the fused region)
FUSED = {
    ("forward", "matmul_reduce_scatter"): "_scaled_dot_product_flash_attention_for_cpu",  # query-split attention
    ("forward", "all_gather_matmul"): "mul",  # silu(w1 x) * w3 x
    ("backward", "all_gather_matmul"): "mul",  # its gradient
}


@pytest.mark.parametrize("options", SCHEDULES, ids=lambda o: o["schedule"])
def test_llama_block_trains_like_eager(ranks, options):
    if ranks.world_size != 2:
        options = {**options, "codegen": False}  # compiled at tp = 2 (suite time)
    results = ranks.run(train_llama_block, STEPS, (ranks.world_size,), options)
    for result in results:
        check(result, ranks.world_size)
        assert all(options["schedule"] in reason for *_, reason in result["sites"]), result["sites"]
        fused = [(site[:2], names) for site, names in zip(result["sites"], result["fused"])]
        for where, op in FUSED.items():
            assert any(w == where and any(n.startswith(op) for n in names) for w, names in fused), (where, fused)
    worst = max(max(r["diffs"].values()) for r in results)
    print(f"\nllama block ws={ranks.world_size} {options}: {STEPS} SGD steps, max relative diff = {worst:.3g}")


def test_llama_block_on_a_2d_mesh(ranks):
    """dp × tp = 2 × 2: rings only ever span the tp group; the dp all-reduce stays as it is."""
    if ranks.world_size != 4:
        pytest.skip("a 2 × 2 mesh needs world size 4")
    # batch 1: DTensor's view form of the sequence gather; m = 2 cuts each [1, S/2, H] shard
    # into blocks of rows
    options = {"schedule": "ring", "chunks_per_rank": 2, "codegen": False}
    results = ranks.run(train_llama_block, STEPS, (2, 2), options, 1)
    tp_groups = set()
    for result in results:
        # With the dp all-reduce in the graph, the q/k weight grads of this setup are sensitive
        # to summation order: plain Inductor (no commfuse) already differs from eager by 1.4e-4
        # relative (measured, rank 0); commfuse measured 1.8e-5 here. A wrong ring or chunk is
        # off by O(1).
        check(result, 2, tol=1e-3)
        tp_groups.add(result["tp_group"])
    assert len(tp_groups) == 2  # two tp groups ({0,1}, {2,3}), each rank rings within its own
    worst = max(max(r["diffs"].values()) for r in results)
    print(f"\nllama block dp=2 x tp=2: {STEPS} SGD steps, max relative diff = {worst:.3g}")
