"""Compile time of ``backend="commfuse"`` vs Inductor alone, and the share of the commfuse pass.

What is measured. A stack of 1, 2, 4, 8 Llama-style transformer blocks (RMSNorm, attention
with q/k/v/o projections, SwiGLU feed-forward) under a torchtitan-style tensor + sequence
parallel plan (per block 2 all-gather → matmul and 2 matmul → reduce-scatter in forward, and
their mirrors in backward), compiled forward + backward with ``backend="commfuse"``
(``schedule="ring"`` by default; ``commfuse-no-fusion`` adds ``fusion=False``,
``commfuse-no-pin`` ``pin_order=False``) and with ``backend="inductor"``. Per stack: the total
compile seconds (the first forward call plus the first backward, each of which compiles its graph; the
toy sizes make running them negligible), the seconds spent in the commfuse pass (the sum of
``pass_seconds`` over the commfuse reports of that compile; the backward graph's pass time is
added to the same report when backward compiles), their ratio, the number of sites
rewritten, and the kernels generated: every C++ (or Triton) kernel the generated code defines,
forward and backward, and how many distinct sources they have (what the compiler compiles;
counted by wrapping Inductor's ``AsyncCompile`` in the measuring process).

How. A single process per (backend, stack) measurement, under a fake process group
(``dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)``): it traces and
compiles at any world size with no communication. Every measurement runs in a fresh process
(forked from a server that only imported torch) with its own fresh ``TORCHINDUCTOR_CACHE_DIR``, so neither Inductor's on-disk caches
nor its in-memory kernel caches are warm; each process first compiles an unrelated one-op
function (untimed) so one-time costs (lazy imports, the first C++ compiler call) land in
neither backend's numbers. Serial compiles (``TORCHINDUCTOR_COMPILE_THREADS=1``), so the
numbers add up on a shared machine; they still depend on machine load (on a shared VM one
process may run a fifth slower than the next), so ``--repeats R`` measures every (stack,
backend) R times, the backends taking turns in a rotated order each round, and reports the
median with its range; the ratio to Inductor is that of the medians.

On a GPU (``--device cuda``) the model's mesh, parameters and inputs are on ``cuda:0`` (still
under the fake process group, so one GPU measures any world size) and the kernels counted are
Inductor's Triton kernels.

``--world-size 2,4,8`` measures each group size in turn (the table's ``ranks``; default 4): a
ring has one step per rank, so what its steps cost the compiler grows with the group.

Usage: ``python benchmarks/compile_time.py [--blocks 1,2,4,8] [--world-size 2,4,8] [--repeats 3]
[--device cpu|cuda] [--json out.json]``; ``--quick`` compiles one block only and skips the
warm-up compile (a smoke test: its numbers include the one-time costs).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from _common import format_table, machine_info, median, progress, run_process, write_json

from commfuse_compile.models import Block, tp_plan

# What each --backends name compiles with (commfuse: with the --schedule given, and these
# options). Without fusion the steps compute only the matmuls, the row-local ops around each
# ring (norms, activations, residual adds) run once on the whole tensor: how much of the
# compile time is those ops computed piece by piece.
# commfuse-no-pin leaves the ring's order to Inductor (``pin_order=False``): what the pins cost.
BACKENDS = {"inductor": None, "commfuse": {}, "commfuse-no-fusion": {"fusion": False}, "commfuse-no-pin": {"pin_order": False}}

# Small dims: compile time hardly depends on them, and they divide by every world size ≤ 8.
DIM, HEADS, FFN, BATCH, SEQ_PER_RANK = 64, 8, 128, 2, 4


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return 0 on success (the process exit status)."""
    args = parse_args(argv)
    rows = []
    try:
        for world_size in args.world_sizes:
            for blocks in args.blocks:
                runs: dict[str, list[dict[str, Any]]] = {backend: [] for backend in args.backends}
                for repeat in range(args.repeats):
                    turn = args.backends[repeat % len(args.backends) :] + args.backends[: repeat % len(args.backends)]
                    for backend in turn:
                        progress(f"compiling {blocks} block(s) at {world_size} ranks with backend={backend!r} in a fresh process (round {repeat + 1})")
                        measured = measure_in_fresh_process(backend, blocks, world_size, args.schedule, not args.quick, args.device)
                        runs[backend].append(measured)
                        progress(f"  {backend}: {measured['total_s']:.1f} s, {measured['unique_kernels']} unique kernels" + _pass_note(measured))
                rows.append({"world_size": world_size, "blocks": blocks, **{backend: summarize(measured) for backend, measured in runs.items()}})
    except RuntimeError as err:
        print(f"compile_time failed: {err}", file=sys.stderr)
        return 1
    results = {
        "benchmark": "compile_time",
        "machine": machine_info(),
        "world_size": args.world_sizes[0] if len(args.world_sizes) == 1 else args.world_sizes,
        "device": args.device,
        "schedule": args.schedule,
        "dims": {"dim": DIM, "heads": HEADS, "ffn": FFN, "batch": BATCH, "seq_per_rank": SEQ_PER_RANK},
        "quick": args.quick,
        "repeats": args.repeats,
        "results": rows,
    }
    print(render(results))
    write_json(args.json, results)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default=None, help="comma-separated stack sizes (default 1,2,4,8; 1 with --quick)")
    parser.add_argument("--world-size", default="4", help="comma-separated sizes of the fake process group, each measured in turn (default 4)")
    parser.add_argument("--schedule", default="ring", help="commfuse schedule option (default ring)")
    parser.add_argument("--backends", default="inductor,commfuse", help=f"comma-separated subset of {','.join(BACKENDS)} (default inductor,commfuse)")
    parser.add_argument("--repeats", type=int, default=1, help="measure every (stack, backend) this many times, in turns (default 1)")
    parser.add_argument("--quick", action="store_true", help="one block, no compiler warm-up: a smoke test")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model and its inputs live (default cpu; cuda compiles Triton kernels on cuda:0)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    args = parser.parse_args(argv)
    text = args.blocks or ("1" if args.quick else "1,2,4,8")
    args.blocks = _integers(parser, "--blocks", text)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.backends or set(args.backends) - set(BACKENDS):
        parser.error(f"--backends must name some of {', '.join(BACKENDS)}")
    if any(b < 1 for b in args.blocks):
        parser.error("--blocks must be positive")
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    args.world_sizes = _integers(parser, "--world-size", args.world_size)
    if not args.world_sizes or any(n < 1 or HEADS % n or FFN % n or DIM % n for n in args.world_sizes):
        parser.error(f"--world-size: each size must divide heads {HEADS}, ffn {FFN} and dim {DIM}")
    return args


def _integers(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """A comma-separated list of integers given to ``option``."""
    try:
        return [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        parser.error(f"{option} must be comma-separated integers, got {text!r}")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One backend's figures over its repeats: each time the median, with ``total_s_min`` /
    ``total_s_max`` and every run's total in ``total_s_runs``; the counts are the first run's
    (they do not vary between runs)."""
    summary = dict(runs[0])
    for key in ("total_s", "forward_s", "backward_s", "pass_s"):
        if key in summary:
            summary[key] = median([run[key] for run in runs])
    totals = [run["total_s"] for run in runs]
    summary.update(total_s_min=min(totals), total_s_max=max(totals), total_s_runs=totals)
    if "pass_fraction" in summary:
        summary["pass_fraction"] = summary["pass_s"] / summary["total_s"]
    return summary


def _pass_note(measured: dict[str, Any]) -> str:
    if "pass_s" not in measured:
        return ""
    return f", pass {measured['pass_s']:.2f} s, {measured['rewritten']}/{measured['sites']} sites rewritten"


def render(results: dict[str, Any]) -> str:
    """The results table as printed on stdout: one line per stack and backend, each commfuse
    variant beside Inductor alone measured in the same run."""
    rows = []
    for row in results["results"]:
        ind = row.get("inductor")
        for backend in (b for b in BACKENDS if b in row):
            m = row[backend]
            vs = ind and backend != "inductor"
            rows.append(
                [
                    row["world_size"],
                    row["blocks"],
                    backend,
                    m["total_s"],
                    f"{m['total_s_min']:.1f}-{m['total_s_max']:.1f}",
                    f"{m['total_s'] / ind['total_s']:.2f}" if vs else None,
                    m["forward_s"],
                    m["backward_s"],
                    m.get("pass_s"),
                    f"{100 * m['pass_fraction']:.1f}%" if "pass_fraction" in m else None,
                    f"{m['rewritten']}/{m['sites']}" if "rewritten" in m else None,
                    f"{m['kernels']} ({m['unique_kernels']})",
                    f"{m['unique_kernels'] / ind['unique_kernels']:.2f}" if vs else None,
                ]
            )
    head = (
        f"\ncompile time (s), fw+bw, Llama-style TP+SP blocks on {results.get('device', 'cpu')}, under a fake process group of each size (ranks), "
        f"commfuse schedule={results['schedule']!r}; median of {results.get('repeats', 1)} run(s) each, range of the totals"
    )
    headers = ["ranks", "blocks", "backend", "total s", "range s", "vs inductor", "fw s", "bw s", "pass s", "pass/total", "rewritten", "kernels (unique)", "unique vs inductor"]
    return "\n".join([head, format_table(headers, rows, left=(2,))])


def measure_in_fresh_process(
    backend: str, blocks: int, world_size: int, schedule: str, warm_up: bool = True, device: str = "cpu"
) -> dict[str, Any]:
    """Run :func:`measure_compile` in a new process with a new, empty Inductor cache dir."""
    cache_dir = tempfile.mkdtemp(prefix="commfuse_compile_time_")
    env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    try:
        return run_process(measure_compile, (backend, blocks, world_size, schedule, warm_up, device), env=env)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def measure_compile(
    backend: str, blocks: int, world_size: int, schedule: str, warm_up: bool = True, device: str = "cpu"
) -> dict[str, Any]:
    """In this (fresh) process: compile ``blocks`` TP blocks fw + bw and time it.

    Returns ``total_s``, ``forward_s``, ``backward_s`` and, for commfuse, ``pass_s``,
    ``pass_fraction``, ``rewritten`` and ``sites`` (counted over every commfuse report of the
    compile: a graph break would make more than one). ``pass_s`` comes from the reports'
    ``pass_seconds``; a commfuse without that field is timed by wrapping its pass instead
    (``pass_s_source`` says which).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commfuse_compile

    torch._inductor.config.compile_threads = 1
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        if warm_up:
            _warm_up_compiler(device)
        timed_pass = _time_the_pass()
        kernels = _count_kernels()
        model = build_stack(blocks, world_size, device)
        extra = BACKENDS[backend]
        options = {} if extra is None else {"options": {"schedule": schedule, **extra}}
        compiled = torch.compile(model, backend="inductor" if extra is None else "commfuse", **options)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(BATCH, SEQ_PER_RANK, DIM, generator=gen).to(device).requires_grad_()  # [B, S/N, H]
        grad = torch.randn(BATCH, SEQ_PER_RANK, DIM, generator=gen).to(device)
        commfuse_compile.clear_reports()
        start = time.perf_counter()
        out = compiled(x)
        middle = time.perf_counter()
        (out * grad).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        measured: dict[str, Any] = {"total_s": end - start, "forward_s": middle - start, "backward_s": end - middle}
        measured.update(kernels=len(kernels), unique_kernels=len(set(kernels)))
        if extra is not None:
            measured.update(_pass_summary(commfuse_compile.reports(), measured["total_s"], timed_pass))
        return measured
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def _warm_up_compiler(device: str = "cpu") -> None:
    """One untimed Inductor compile of an unrelated function, and commfuse's lazy imports."""
    importlib.import_module("commfuse_compile.passes")  # the pass imports it on first use

    torch.compile(lambda t: (t * 2).sin(), backend="inductor")(torch.randn(8, device=device))


def _count_kernels() -> list[str]:
    """Wrap Inductor's kernel compiles in this process: the returned list gets each kernel's
    source as the generated code defines it (a source defined twice is compiled once)."""
    from torch._inductor.async_compile import AsyncCompile

    sources: list[str] = []

    def counted(original: Any, source_at: int) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            sources.append(args[source_at])
            return original(self, *args, **kwargs)

        return wrapper

    AsyncCompile.cpp_pybinding = counted(AsyncCompile.cpp_pybinding, 1)  # (argtypes, source)
    AsyncCompile.triton = counted(AsyncCompile.triton, 1)  # (name, source, ...)
    return sources


def _time_the_pass() -> list[float]:
    """Wrap the commfuse pass of this process to add its wall seconds to the returned list.

    A fallback for a commfuse whose reports have no ``pass_seconds``; the wrapper is local to
    this benchmark process.
    """
    from commfuse_compile import backend

    seconds = [0.0]
    original = backend.CommfusePass.__call__

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - start

    backend.CommfusePass.__call__ = timed
    return seconds


def _pass_summary(reports: list[Any], total_s: float, timed_pass: list[float]) -> dict[str, Any]:
    from_reports = all(hasattr(r, "pass_seconds") for r in reports) and bool(reports)
    pass_s = sum(r.pass_seconds for r in reports) if from_reports else timed_pass[0]
    sites = [s for r in reports for s in r.sites]
    rewritten = [s for s in sites if s.rewritten]
    return {
        "pass_s": pass_s,
        "pass_fraction": pass_s / total_s,
        "pass_s_source": "report.pass_seconds" if from_reports else "timed wrapper",
        "pass_s_timed": timed_pass[0],
        "rewritten": len(rewritten),
        "sites": len(sites),
        "reports": len(reports),
        "skipped_reasons": sorted({s.reason for s in sites if not s.rewritten}),
    }


# --- the model: Llama-style blocks (commfuse_compile.models) under a TP + SP plan ----------


def build_stack(blocks: int, world_size: int, device: str = "cpu") -> nn.Module:
    """``blocks`` Llama-style blocks in an ``nn.Sequential``, parallelised over all ranks.

    Inside a container so that each block's input hook (Shard(1) → Replicate) is traced into
    the graph.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    stack = nn.Sequential(*(Block(DIM, HEADS, FFN) for _ in range(blocks)))
    mesh = init_device_mesh(device, (world_size,))
    plan = {key: style for i in range(blocks) for key, style in tp_plan(f"{i}.").items()}
    return parallelize_module(stack, mesh, plan)


if __name__ == "__main__":
    sys.exit(main())
