"""Fully-sharded data parallel under ``backend="commfuse"``.

FSDP2's ``fully_shard`` (torch 2.13) issues its parameter all-gathers and gradient
reduce-scatters from hooks Dynamo never traces (``_dynamo_disable`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``), so no compiled graph sees them: the
first test pins down that a user gets correct results and no false claim. The traceable form,
:func:`commfuse_compile.simple_fsdp` (DTensor parametrization, as torchtitan's SimpleFSDP), puts
them in the graphs; the other tests check that every weight gather and gradient scatter becomes
a ring and that training equals the unsharded model on the whole batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import commfuse_compile
from programs import DTYPES, TOLERANCES

pytestmark = pytest.mark.slow


def fsdp2_mlp_against_eager() -> dict:
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    commfuse_compile.clear_reports()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 16, bias=False))
    reference = copy.deepcopy(model)
    for m in (model, reference):  # the eager reference is the same FSDP2 model, uncompiled
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    compiled = torch.compile(model, backend="commfuse")
    x = torch.randn(4, 16) + dist.get_rank()
    out, expected = compiled(x), reference(x)
    out.sum().backward()
    expected.sum().backward()
    grad_diff = max(
        (p.grad.full_tensor() - r.grad.full_tensor()).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters())
    )
    sites = [s for report in commfuse_compile.reports() for s in report.sites]
    return dict(out_diff=(out - expected).abs().max().item(), grad_diff=grad_diff, rewritten=[s for s in sites if s.rewritten])


def simple_fsdp_trains_like_unsharded(dtype_name: str, codegen: bool = True, steps: int = 2) -> dict:
    """Train a 3-layer MLP sharded with simple_fsdp (layer 0 keeps its gathered weight for
    backward, layers 2 and 4 re-gather it) on this rank's rows of a batch, compiled with
    commfuse; train the unsharded model on the whole batch eagerly; compare outputs and weights."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    commfuse_compile.clear_reports()
    dtype, rank, world = DTYPES[dtype_name], dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32, bias=False), nn.ReLU(), nn.Linear(32, 16)
    ).to(dtype)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    commfuse_compile.simple_fsdp(model[0], mesh, reshard_after_forward=False)
    commfuse_compile.simple_fsdp(model[2], mesh)
    commfuse_compile.simple_fsdp(model[4], mesh)
    compiled = torch.compile(model, backend="commfuse", options={"schedule": "ring", "codegen": codegen})
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, foreach=False) for m in (model, reference)]
    diffs = []
    for step in range(steps):
        batch = torch.randn(4 * world, 16, generator=torch.Generator().manual_seed(step)).to(dtype)
        out = compiled(batch.chunk(world)[rank])
        expected = reference(batch)
        out.float().square().sum().backward()  # summed over ranks: the loss of the whole batch
        expected.float().square().sum().backward()
        diffs.append(_difference("out", out, expected.chunk(world)[rank], dtype))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
            diffs.append(_difference(f"{name}@{step}", param.full_tensor(), ref, dtype))
    sites = [(s.graph, s.pattern, s.action) for report in commfuse_compile.reports() for s in report.sites]
    return dict(diffs=diffs, sites=sites)


def _difference(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> dict:
    a, e = actual.detach().float(), expected.detach().float()
    tol = TOLERANCES[dtype]
    diff = (a - e).abs().max().item()
    if dtype == torch.float32:
        close = torch.allclose(a, e, **tol)
    else:
        close = diff <= tol["atol"] + tol["rtol"] * e.abs().max().item()
    return dict(name=name, max_abs_diff=diff, close=close)


def test_fsdp2_mlp_equals_eager(ranks):
    if ranks.world_size != 2:
        pytest.skip("one world size is enough: nothing here depends on it")
    for result in ranks.run(fsdp2_mlp_against_eager):
        assert result["out_diff"] <= 1e-5 and result["grad_diff"] <= 1e-5, result
        assert result["rewritten"] == []  # FSDP2's collectives never reach a compiled graph


# Per compile: forward gathers the 3 weights (the biases' 1-D gathers have no matmul) and
# backward re-gathers the 2 resharded weights that dX reads (layer 0's dX is not needed) and
# scatters the 3 weight grads (the bias grads are column sums, not matmuls).
EXPECTED_SIMPLE_FSDP_SITES = sorted(
    [("forward", "all_gather_matmul", "rewritten")] * 3
    + [("forward", "all_gather_matmul", "skipped")] * 2
    + [("backward", "all_gather_matmul", "rewritten")] * 2
    + [("backward", "matmul_reduce_scatter", "rewritten")] * 3
    + [("backward", "matmul_reduce_scatter", "skipped")] * 2
)


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_simple_fsdp_trains_like_unsharded(ranks, dtype_name):
    # fp32 at 2 ranks compiled by Inductor; the others run the rewritten graphs op by op
    # (codegen=False), which is the same rewrite at a fraction of the suite's time
    compiled = dtype_name == "fp32" and ranks.world_size == 2
    for rank, result in enumerate(ranks.run(simple_fsdp_trains_like_unsharded, dtype_name, compiled)):
        bad = [d for d in result["diffs"] if not d["close"]]
        assert not bad, (rank, bad)
        assert sorted(result["sites"]) == EXPECTED_SIMPLE_FSDP_SITES, (rank, result["sites"])
