"""The ``explain``, ``simulate`` and ``bench`` commands of ``python -m commfuse_compile``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import runpy
import sys

import torch

EXPLAIN = """Explain what backend="commfuse" does to a model, in one process at any world size.

FILE defines FUNCTION(world_size) returning (model_or_fn, example_inputs): it is called inside
a fake process group of --world-size ranks (build DTensor meshes / plans there as usual), then
the model is compiled forward and backward as the backend would, without communicating, and
the report printed: every match, its decision, reason and cost estimates."""

SIMULATE = """Model one matmul + collective on a hardware profile: vanilla, slicing, ring and
bidirectional (the candidates auto considers), with their exposed communication, and auto's
choice. The matmul is [M, K] @ [K, N]; the gathered (all_gather_matmul) or scattered
(matmul_reduce_scatter) dim is M."""

BENCH = """Run a benchmark script from the repository's benchmarks/ directory (arguments after
the name go to the script; `bench NAME --help` shows them)."""

BENCHMARKS = {
    "step-time": "step_time.py",
    "model-step": "model_step.py",
    "compile-time": "compile_time.py",
    "peak-memory": "peak_memory.py",
    "moe-memory": "moe_memory.py",
    "paper": "simulate_paper.py",
    "calibrate": "calibrate_cpu_profile.py",
}


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a Python file")
    parser.add_argument("function", help="FUNCTION(world_size) -> (model_or_fn, example_inputs)")
    parser.add_argument("--world-size", type=int, default=8, help="ranks of the fake process group (default 8)")
    parser.add_argument("--rank", type=int, default=0, help="the rank to explain (default 0)")
    parser.add_argument("--options", default="{}", help='backend options as JSON, e.g. \'{"schedule": "ring"}\'')
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="cuda: plan the graphs a GPU compile would build, on fake tensors (no GPU needed; parameters may be on meta)",
    )
    parser.add_argument("--dot", metavar="PATH", help="write the first rewritten match's region as DOT")
    parser.add_argument("--trace", metavar="PATH", help="write the modelled timelines as a Chrome trace (JSON)")


def run_explain(args: argparse.Namespace) -> int:
    from .explain import explain, fake_world

    spec = importlib.util.spec_from_file_location("commfuse_explained", args.file)
    if spec is None or spec.loader is None:
        raise SystemExit(f"explain: cannot load {args.file!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    build = getattr(module, args.function, None)
    if not callable(build):
        raise SystemExit(f"explain: {args.file} has no function {args.function!r}")
    with fake_world(args.world_size, args.rank):
        model, inputs = build(args.world_size)
        report = explain(model, *inputs, options=json.loads(args.options), backward=not args.no_backward, device=args.device)
    print(report.summary())
    if args.dot:
        print(f"wrote {report.to_dot(args.dot)}")
    if args.trace:
        report.to_chrome_trace(args.trace)
        print(f"wrote {args.trace}")
    return 0


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pattern", choices=["all_gather_matmul", "matmul_reduce_scatter"], default="all_gather_matmul")
    parser.add_argument("-M", type=int, default=8192, help="rows (the gathered / scattered dim)")
    parser.add_argument("-K", type=int, default=4096, help="contraction dim")
    parser.add_argument("-N", type=int, default=4096, help="output columns")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--profile", default="h100-nvlink", help="a built-in profile name (default h100-nvlink)")
    parser.add_argument("--trace", metavar="PATH", help="write every schedule's timeline as a Chrome trace")


def run_simulate(args: argparse.Namespace) -> int:
    from .cost_model import Matmul, Workload, bidirectional_pays, candidates, choose, estimate
    from .profiles import resolve_profile
    from .schedules import pieces_per_chunk

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.M % args.group_size:
        raise SystemExit(f"simulate: -M {args.M} does not split into --group-size {args.group_size} chunks")
    moved_cols = args.K if args.pattern == "all_gather_matmul" else args.N
    chunk_bytes = args.M // args.group_size * moved_cols * torch.finfo(dtype).bits // 8
    work = Workload(args.pattern, args.group_size, (Matmul(args.M, args.K, args.N, "m"),), chunk_bytes, dtype)
    profile = resolve_profile(args.profile)
    vanilla = estimate(work, profile, "vanilla")
    fits = [(s, m) for s, m in candidates("auto", None, bidirectional_pays(profile, args.group_size)) if args.M % (args.group_size * pieces_per_chunk(s, m)) == 0]
    others = [estimate(work, profile, s, m) for s, m in fits]
    print(f"{args.pattern}: [{args.M}, {args.K}] @ [{args.K}, {args.N}] {args.dtype}, group of {args.group_size}, profile {profile.name}")
    print(f"{'schedule':<20}{'ms':>10}{'exposed comm ms':>17}{'vs vanilla':>12}")
    for e in [vanilla, *others]:
        print(f"{e.label:<20}{e.seconds * 1e3:>10.3f}{e.exposed_comm * 1e3:>17.3f}{vanilla.seconds / e.seconds:>11.2f}x")
    best = choose(others, vanilla, 1.0)
    print(f"auto: {best.label if best else 'leave it alone (nothing beats vanilla)'}")
    if args.trace:
        from .trace import write_chrome_trace

        write_chrome_trace(args.trace, [vanilla, *others], title=f"simulate {args.pattern}")
        print(f"wrote {args.trace}")
    return 0


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")


def run_bench(args: argparse.Namespace) -> int:
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / BENCHMARKS[args.name]
    if not script.exists():
        raise SystemExit(f"bench: {script} not found; benchmarks run from a checkout of the repository (pip install -e .)")
    sys.argv = [str(script), *args.args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0)
    return 0


CALIBRATE = """Measure what auto's cost model assumes — the matmul rate, the link to the ring
neighbours (latency per step, bandwidth, both directions at once) and the slowdown of compute
under transfer — on this machine's process group, agree on it across the ranks and cache it on
disk (``$COMMFUSE_CACHE_DIR``, default ~/.cache/commfuse), where the backend's first compile
finds it instead of measuring. Under torchrun: the job's group (NCCL with GPUs); otherwise
--world-size gloo ranks on this machine, one thread each (as the CPU tests and benchmarks run)."""


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=None, help="gloo ranks to spawn (default 2); under torchrun its WORLD_SIZE")
    parser.add_argument("--force", action="store_true", help="measure again even where a cached profile exists")


def run_calibrate(args: argparse.Namespace) -> int:
    from . import demo

    if demo._under_torchrun():
        _calibrate_rank(None, args.force)
        return 0
    world_size = 2 if args.world_size is None else args.world_size
    if world_size < 2:
        print(f"calibrate: --world-size must be at least 2 (a link needs two ends), got {world_size}", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    mp.spawn(_calibrate_rank, args=(args.force, world_size, demo._free_port()), nprocs=world_size, join=True)
    return 0


def _calibrate_rank(rank: int | None, force: bool, world_size: int = 0, port: int = 0) -> None:
    """One rank: join the group (torchrun's, or the spawned gloo one), measure, print on rank 0."""
    import os

    import torch.distributed as dist

    from . import calibrate

    if rank is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        key = calibrate.cache_key()
        if force:
            calibrate.cache_path(key).unlink(missing_ok=True)
        profile = calibrate.measured_profile()
        if dist.get_rank() == 0 and profile is not None:
            print(f"{profile.name}, {profile.source}\n  {calibrate.describe(profile)}\n  cached in {calibrate.cache_path(key)}")
            print(json.dumps(calibrate.as_option(profile), indent=2))
    finally:
        dist.destroy_process_group()
