"""All-to-alls whose split sizes are known only at run time (MoE token dispatch and combine),
on gloo ranks at world sizes 2 and 4: decomposed into pairwise steps, forward and backward,
fp32 and bf16, against eager, over routings that leave a rank or a direction empty — with one
compile for all of them.

The program (``routed.py``) exchanges its token counts, reads them with ``.tolist()`` and
dispatches / combines with those splits, as an MoE token dispatcher does; the counts exchange
itself is left alone (its result goes to the host).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from programs import DTYPES, TOLERANCES, compare, ring_events

import commfuse_compile
import routed
from commfuse_compile._compat import work_registry_size

pytestmark = pytest.mark.slow

# Balanced; every token to one rank (the others receive nothing); all local (nothing travels);
# random; random with the last rank receiving nothing; random again (new sizes, same graph).
ROUTINGS = ["balanced", "one_rank", "local", "random", "empty_rank", "random"]
# program: (function, its inputs, its routing, sites other than the counts exchange per layer)
PROGRAMS = {
    "one_layer": (routed.routed_moe, routed.inputs, routed.routing),
    "two_layers": (routed.two_layers, routed.inputs, routed.routing),
    "grouped_experts": (routed.grouped_experts, routed.expert_inputs, routed.expert_routing),
    "two_expert_layers": (routed.two_expert_layers, routed.expert_inputs, routed.expert_routing),
}
# Per layer: the counts exchange, left alone; dispatch and combine, and their backward ones.
COUNTS = ("forward", "all_to_all", "skipped")
DATA = [("forward", "all_to_all", "rewritten")] * 2 + [("backward", "all_to_all", "rewritten")] * 2


def _forward_backward(fn, inputs, destination):
    for t in inputs:
        t.grad = None
    out = fn(*inputs, destination)
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    (out * torch.randn(out.shape, generator=gen).to(out.dtype)).sum().backward()
    return [out.detach()] + [t.grad.clone() for t in inputs]


def check_routings(program: str, dtype_name: str, codegen: bool) -> dict:
    """Compile ``program`` once; run it on every routing of ROUTINGS against eager."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch._dynamo.config.capture_scalar_outputs = True
    dtype = DTYPES[dtype_name]
    rank, world = dist.get_rank(), dist.get_world_size()
    fn, make_inputs, routing = PROGRAMS[program]
    inputs = make_inputs(rank, world, dtype)
    options = {"schedule": "ring"} if codegen else {"schedule": "ring", "codegen": False}
    compiled = torch.compile(fn, backend="commfuse", options=options, fullgraph=True)
    seen = len(commfuse_compile.reports())
    registry = work_registry_size()
    diffs, code = [], []
    for call, kind in enumerate(ROUTINGS + ["empty_expert"] * (program in ("grouped_experts", "two_expert_layers"))):
        destination = routing(kind, rank, world, call)
        expected = _forward_backward(fn, inputs, destination)
        if call == 0 and codegen:
            actual, code = run_and_get_code(_forward_backward, compiled, inputs, destination)
        else:
            actual = _forward_backward(compiled, inputs, destination)
        diffs.append(dict(routing=kind, rows=compare(actual, expected, dtype)))
    reports = commfuse_compile.reports()[seen:]
    sites = [s for r in reports for s in r.sites]
    return dict(
        diffs=diffs,
        compiles=len(reports),
        sites=[(s.graph, s.pattern, s.action) for s in sites],
        steps=[len(s.steps) for s in sites],
        reasons=[s.reason for s in sites],
        fused=[s.fused for s in sites],
        events=[ring_events(c) for c in code],
        registry=(registry, work_registry_size()),
    )


# (fp32 and bf16 each compiled by Inductor once; the expert-parallel pipeline below adds op-by-op bf16)
@pytest.mark.parametrize("program,dtype,codegen", [
    ("one_layer", "fp32", True),
    ("two_layers", "bf16", True),
], ids=lambda v: str(v))
def test_routings_match_eager_with_one_compile(ranks, program, dtype, codegen):
    results = ranks.run(check_routings, program, dtype, codegen)
    layers = 1 if program == "one_layer" else 2
    n = ranks.world_size
    for rank, result in enumerate(results):
        assert result["compiles"] == 1, result["compiles"]  # unbacked sizes: no recompile per routing
        forward = [COUNTS, *DATA[:2]] * layers
        assert sorted(result["sites"]) == sorted(forward + DATA[2:] * layers), result["reasons"]
        for call in result["diffs"]:
            for row in call["rows"]:
                assert row["close"], f"rank {rank} {call['routing']} {row} exceeds {TOLERANCES[DTYPES[dtype]]}"
        # the dispatch computes the expert FFN on each block as it arrives
        dispatch = result["fused"][1]
        assert any(name.startswith("mm") for name in dispatch), dispatch
        assert result["registry"][1] == result["registry"][0]  # every transfer waited on
        if codegen:  # forward: dispatch and combine, N - 1 steps each
            forward_code = result["events"][0]
            assert len(forward_code) == 2 * (n - 1) * layers, forward_code
            # the dispatch's steps run the FFN of the blocks arrived (its first step, at N > 2,
            # the gate of the next block to send: row-local before the dispatch)
            dispatch_steps = forward_code[: n - 1]
            assert all(mms >= 1 for _, mms, _ in dispatch_steps[1:] or dispatch_steps), forward_code
    worst = max(row["max_abs_diff"] for r in results for call in r["diffs"] for row in call["rows"])
    print(f"\n{program} {dtype} ws={n}: max |commfuse - eager| over {len(ROUTINGS)} routings = {worst:.3g}")


@pytest.mark.parametrize("program,dtype,codegen", [
    ("grouped_experts", "fp32", True),
    ("grouped_experts", "bf16", False),
    ("two_expert_layers", "fp32", False),
], ids=lambda v: str(v))
def test_expert_parallel_pipeline_matches_eager(ranks, program, dtype, codegen):
    """torchtitan's form (permute to expert-major, grouped experts, permute back) as one
    ``moe_ep`` pipeline, forward and backward: dispatch and combine steps interleaved, the
    experts (their input gradients) on each source rank's tokens with its own offsets. The
    routings include an empty rank and an empty expert; one compile."""
    results = ranks.run(check_routings, program, dtype, codegen)
    n, layers = ranks.world_size, 1 if program == "grouped_experts" else 2
    for rank, result in enumerate(results):
        assert result["compiles"] == 1, result["compiles"]
        expected = [COUNTS, ("forward", "moe_ep", "rewritten")] * layers + [("backward", "moe_ep", "rewritten")] * layers
        assert result["sites"] == expected, result["reasons"]
        pipelines = [i for i, site in enumerate(result["sites"]) if site[1] == "moe_ep"]
        assert [result["steps"][i] for i in pipelines] == [2 * (n - 1)] * 2 * layers  # n - 1 dispatch and n - 1 combine steps
        # forward: 2 grouped matmuls per source rank; backward: the 2 of dX (the weight
        # gradients read every row: once, after the last block)
        assert [sum(name.startswith("_grouped_mm") for name in result["fused"][i]) for i in pipelines] == [2] * 2 * layers, result["fused"]
        for call in result["diffs"]:
            for row in call["rows"]:
                assert row["close"], f"rank {rank} {call['routing']} {row} exceeds {TOLERANCES[DTYPES[dtype]]}"
        assert result["registry"][1] == result["registry"][0]
        if codegen:
            assert [len(events) for events in result["events"]] == [2 * (n - 1)] * 2, result["events"]
    worst = max(row["max_abs_diff"] for r in results for call in r["diffs"] for row in call["rows"])
    print(f"\n{program} {dtype} ws={n}: max |commfuse - eager| = {worst:.3g}")


def check_new_token_count() -> dict:
    """A different number of tokens: one more compile (the token dim becomes symbolic), still
    decomposed and correct; the routings after it reuse that graph."""
    torch._dynamo.reset()
    torch._dynamo.config.capture_scalar_outputs = True
    rank, world = dist.get_rank(), dist.get_world_size()
    compiled = torch.compile(routed.routed_moe, backend="commfuse", options={"schedule": "ring", "codegen": False}, fullgraph=True)
    seen = len(commfuse_compile.reports())
    rows = []
    for call, tokens in enumerate([routed.TOKENS, routed.TOKENS - 4, routed.TOKENS + 4, routed.TOKENS - 4]):
        inputs = routed.inputs(rank, world, torch.float32, tokens)
        destination = routed.routing("random", rank, world, call, tokens)
        rows += compare(_forward_backward(compiled, inputs, destination), _forward_backward(routed.routed_moe, inputs, destination), torch.float32)
    reports = commfuse_compile.reports()[seen:]
    return dict(rows=rows, compiles=len(reports), sites=[[(s.graph, s.action, s.reason) for s in r.sites] for r in reports])


def test_a_new_token_count_compiles_once_more(ranks):
    for result in ranks.run(check_new_token_count):
        assert result["compiles"] == 2, result["sites"]
        assert all(row["close"] for row in result["rows"]), result["rows"]
        dynamic = result["sites"][1]
        assert [action for graph, action, _ in dynamic].count("rewritten") == 4, dynamic
