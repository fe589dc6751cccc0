"""A Llama-style transformer block under a torchtitan-style tensor + sequence parallel plan,
and the rank-side function that trains it compiled and eagerly side by side."""

from __future__ import annotations

import copy

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

import commfuse_compile
from commfuse_compile import models

# With batch 1 DTensor gathers the sequence with a plain view ([N, S/N, H] -> [1, S, H]) instead
# of split + cat: the 2-D mesh test trains at batch 1, the others at BATCH.
DIM, HEADS, FFN, BATCH, SEQ = 32, 4, 64, 2, 8


def Block() -> nn.Module:
    return models.Block(DIM, HEADS, FFN)


tp_plan = models.tp_plan


def train_llama_block(steps: int, mesh_shape: tuple[int, ...], options: dict | None = None, batch: int = BATCH) -> dict:
    """Train one block for ``steps`` SGD steps compiled with commfuse and eagerly, side by side.

    ``mesh_shape`` (tp,) or (dp, tp): the block is parallelised over the tp sub-mesh; with a dp
    dim each dp replica gets its own batch and the loss is summed over dp inside the compiled
    function (a collective of another group that must stay as it is).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch._dynamo.reset()
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    tp = mesh["tp"]
    dp_group = mesh["dp"].get_group() if "dp" in names else None
    torch.manual_seed(0)
    eager = parallelize_module(Block(), tp, tp_plan())
    compiled_block = copy.deepcopy(eager)
    compiled = torch.compile(compiled_block, backend="commfuse", options=options or {"schedule": "ring"})

    def step_fn(model):
        def run(x, g):
            out = model(x)
            loss = (out * g).sum()
            if dp_group is not None:
                loss = funcol.all_reduce(loss, "sum", dp_group)
            return out, loss

        return run

    tp_rank, tp_size = tp.get_local_rank(), tp.size()
    dp_rank = mesh["dp"].get_local_rank() if dp_group is not None else 0
    diffs: dict[str, float] = {}

    def note(name, a, b):
        # Relative to the tensor's magnitude: grads of sums over all tokens are large.
        a, b = _local(a).float(), _local(b).float()
        rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
        diffs[name] = max(diffs.get(name, 0.0), rel)

    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_block)]
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + dp_rank)
        x = torch.randn(batch, SEQ, DIM, generator=gen).chunk(tp_size, dim=1)[tp_rank].contiguous()
        g = torch.randn(batch, SEQ, DIM, generator=gen).chunk(tp_size, dim=1)[tp_rank].contiguous()
        outs = []
        for model, opt in zip((step_fn(eager), step_fn(compiled)), opts):
            opt.zero_grad()
            out, loss = model(x, g)
            loss.backward()
            outs.append((out.detach(), loss.detach()))
        note("output", outs[1][0], outs[0][0])
        note("loss", outs[1][1], outs[0][1])
        for (name, p_e), p_c in zip(eager.named_parameters(), compiled_block.parameters()):
            note(f"grad {name}", p_c.grad, p_e.grad)
        for opt in opts:
            opt.step()
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled_block.parameters()):
        note(f"param {name}", p_c, p_e)
    report = commfuse_compile.last_report()
    return dict(
        diffs=diffs,
        sites=[(s.graph, s.pattern, s.action, s.group_name, s.group_size, s.reason) for s in report.sites],
        fused=[s.fused for s in report.sites],
        tp_group=tp.get_group().group_name,
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
