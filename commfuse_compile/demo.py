"""Demo: a sequence-parallel MLP compiled with ``backend="commfuse"``, checked against eager.

    python -m commfuse_compile demo [--world-size N]
    python examples/tp_mlp.py [--world-size N]
    torchrun --nproc-per-node N examples/tp_mlp.py

Each rank holds a row shard of the activations and a column / row shard of the two weights::

    h   = all_gather(x)                 # [N·B, S, H]   (x: [B, S, H], this rank's rows)
    y   = relu(h @ w1) @ w2             # w1 [H, F/N] column shard, w2 [F/N, H] row shard
    out = reduce_scatter(y, "sum")      # [B, S, H]     (this rank's rows of the full sum)

so the forward graph holds exactly the two patterns commfuse rewrites (all-gather → mm and
mm → reduce-scatter), and the backward graph their mirror images. The demo runs the model
eagerly and compiled on the same inputs, and rank 0 prints what the pass did (one line per
site), the ring steps of the rewritten forward graph, and the largest difference from eager
over all ranks.

Started as a plain script it spawns N CPU ranks itself (gloo, no torchrun needed). Started by
torchrun it runs the one rank torchrun gave it (NCCL on CUDA, gloo otherwise).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch import nn

import commfuse_compile
from commfuse_compile.report import Report, StepRecord

# Small sizes: the demo must compile and run in well under a minute on a 2-core machine, with
# every rank compiling the forward and backward graphs on its own.
BATCH = 2  # rows of x per rank (the sharded dim 0)
SEQ = 16
HIDDEN = 64
FFN_PER_RANK = 32  # the full FFN width is FFN_PER_RANK·N, so any world size divides it

# fp32 end to end; the ring only reorders which rows each matmul computes (Flash-AG) or the
# order of the sum (Flash-RS), so differences from eager are rounding only.
TOLERANCE = 1e-4

# A rank that waits longer than this in a collective (e.g. a peer died mid-compile) fails
# instead of hanging; generous because ranks compile concurrently on few cores.
PG_TIMEOUT = timedelta(seconds=300)

DESCRIPTION = (
    "Compile a sequence-parallel MLP with backend='commfuse' on N CPU ranks (or the ranks "
    "torchrun started) and compare its output and gradients with eager."
)


class SequenceParallelMLP(nn.Module):
    """Two-layer MLP sharded over ``group``: all-gather → matmuls → reduce-scatter."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, group: dist.ProcessGroup):
        super().__init__()
        self.w1 = nn.Parameter(w1)  # [H, F/N]: this rank's columns of the full w1
        self.w2 = nn.Parameter(w2)  # [F/N, H]: this rank's rows of the full w2
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # all_gather_single / reduce_scatter_single are the differentiable functional
        # collectives (all_gather_tensor / reduce_scatter_tensor are deprecated aliases of
        # them in torch 2.13 and warn in eager). Gradients flow back through the mirrored
        # collectives, so the backward graph has all-gather → mm and mm → reduce-scatter too.
        h = funcol.all_gather_single(x, 0, self.group)
        y = torch.relu(h @ self.w1) @ self.w2
        return funcol.reduce_scatter_single(y, "sum", 0, self.group)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the process exit status (0 when every rank succeeded)."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options (shared with ``python -m commfuse_compile demo``)."""
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of CPU ranks to spawn (default 2); under torchrun, torchrun's WORLD_SIZE is used",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo for parsed ``args``: under torchrun this one rank, otherwise spawn ranks."""
    if _under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, world_size):
            print(
                f"--world-size {args.world_size} conflicts with torchrun's WORLD_SIZE={world_size}",
                file=sys.stderr,
            )
            return 2
        _torchrun_rank()
        return 0

    world_size = 2 if args.world_size is None else args.world_size
    if world_size < 1:
        print(f"--world-size must be at least 1, got {world_size}", file=sys.stderr)
        return 2
    try:
        # join=True: if one rank raises, spawn terminates the others and raises here, so a
        # failed rank never leaves its peers hanging in a collective.
        mp.spawn(_spawned_rank, args=(world_size, _free_port()), nprocs=world_size, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        print(f"commfuse demo failed: {err}", file=sys.stderr)
        return 1
    return 0


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _free_port() -> int:
    # Bind to port 0 so the OS picks a free port; the ranks rendezvous on it right after.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_rank(rank: int, world_size: int, port: int) -> None:
    """Entry point of a spawned CPU rank (module level so that spawn can import it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
    try:
        run_rank(torch.device("cpu"))
    finally:
        _shutdown()


def _torchrun_rank() -> None:
    """This process is one rank started by torchrun (which also set MASTER_ADDR/PORT)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=PG_TIMEOUT, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    try:
        run_rank(device)
    finally:
        _shutdown()


def _shutdown() -> None:
    """Destroy the process group so that its worker threads stop while Python is still alive.

    ``destroy_process_group`` frees the group (and joins gloo's worker threads) only if nothing
    else references it; Dynamo's caches and reference cycles of the compiled model still do. A
    gloo thread that then drops the last reference to a collective's tensor during interpreter
    shutdown cannot take the GIL and aborts the process ("terminate called without an active
    exception", SIGABRT) — intermittently, after the demo has succeeded. So drop those
    references first.
    """
    torch._dynamo.reset()
    gc.collect()
    dist.destroy_process_group()


def run_rank(device: torch.device) -> None:
    """The demo on one initialised rank: eager vs compiled forward + backward, report on rank 0.

    Raises if the compiled model differs from eager by more than ``TOLERANCE`` on any rank.
    """
    cache_dir = _isolate_compile()
    try:
        _compare(device)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def _compare(device: torch.device) -> None:
    """Build this rank's shard of the model, run it eagerly and compiled, compare and report."""
    if device.type == "cpu":
        torch.set_num_threads(1)  # several ranks share few cores: don't oversubscribe them
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    # Same seed everywhere: every rank builds the same full weights and inputs, then keeps
    # its shard — so the sharded model computes exactly the unsharded one.
    gen = torch.Generator().manual_seed(0)
    ffn = FFN_PER_RANK * world_size
    w1 = torch.randn(HIDDEN, ffn, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(ffn, HIDDEN, generator=gen) / ffn**0.5
    x_full = torch.randn(BATCH * world_size, SEQ, HIDDEN, generator=gen)
    grad_full = torch.randn(BATCH * world_size, SEQ, HIDDEN, generator=gen)
    cols = slice(rank * FFN_PER_RANK, (rank + 1) * FFN_PER_RANK)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    model = SequenceParallelMLP(w1[:, cols].clone(), w2[cols].clone(), group).to(device)
    x, grad_out = x_full[rows].to(device), grad_full[rows].to(device)

    eager = _forward_backward(model, x, grad_out)
    commfuse_compile.clear_reports()
    # The demo's sizes are far too small for schedule="auto" to decompose anything on CPU
    # (it would rightly leave them alone): ask for the ring to show it.
    compiled = _forward_backward(torch.compile(model, backend="commfuse", options={"schedule": "ring"}), x, grad_out)
    report = commfuse_compile.last_report()  # forward and backward: one backend call

    # Each rank measures its own shards; MAX over ranks gives the worst anywhere.
    names = list(eager)
    diffs = torch.tensor(
        [(compiled[k] - eager[k]).abs().max().item() for k in names], dtype=torch.float64, device=device
    )
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)

    if rank == 0:
        _print_report(report, dict(zip(names, diffs.tolist())), world_size)
    worst = diffs.max().item()
    if worst > TOLERANCE:
        raise AssertionError(f"compiled differs from eager by {worst:.3g} > {TOLERANCE:g}")


def _isolate_compile() -> str:
    """A private Inductor cache and no compile worker pool, before anything is compiled.

    A private cache keeps a warm cache from an earlier run from serving graphs without running
    the pass (the report would then be empty). One compile thread: ranks already share the cores.
    Returns the cache directory, for the caller to remove.
    """
    import torch._inductor.config as inductor_config

    cache_dir = tempfile.mkdtemp(prefix=f"commfuse_demo_rank{dist.get_rank()}_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    # Inductor read TORCHINDUCTOR_COMPILE_THREADS when its config was imported (importing
    # commfuse_compile already did that), so set the config value too.
    inductor_config.compile_threads = 1
    return cache_dir


def _forward_backward(model: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output and gradients of one forward + backward, detached copies."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad_out)
    return {
        "output": out.detach().clone(),
        "grad x": x.grad.clone(),
        "grad w1": model.w1.grad.clone(),
        "grad w2": model.w2.grad.clone(),
    }


def _print_report(report: Report | None, diffs: dict[str, float], world_size: int) -> None:
    print(f"commfuse demo: sequence-parallel MLP on {world_size} rank(s), per-rank x [{BATCH}, {SEQ}, {HIDDEN}]")
    if report is None:
        print("no commfuse compile happened")
    else:
        print(f"sites ({len(report.rewritten)} rewritten, {len(report.skipped)} skipped):")
        for site in report.sites:
            print(f"  {site.summary()}")
        for error in report.errors:
            print(f"  {error}")
        forward = [s for s in report.sites if s.graph == "forward" and s.rewritten]
        if forward:
            print("forward ring steps:")
        for site in forward:
            print(f"  {site.pattern} on rank {site.rank}:")
            for i, step in enumerate(site.steps):
                print(f"    step {i}: {format_step(step)}")
    print("max |compiled - eager| over all ranks:")
    for name, diff in diffs.items():
        print(f"  {name}: {diff:.3g}")
    sys.stdout.flush()


def format_step(step: StepRecord) -> str:
    """One ring step as ``start X → mm (chunk j) → wait Y``; X/Y omitted where there is none."""
    parts = []
    if step.start is not None:
        parts.append(f"start {step.start}")
    parts.append(f"{', '.join(step.compute)} (chunk {step.chunk})")
    if step.wait is not None:
        parts.append(f"wait {step.wait}")
    return " → ".join(parts)
