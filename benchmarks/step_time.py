"""Step time of a tensor-parallel MLP on real gloo ranks: Inductor vs commfuse's schedules.

What is measured. One forward + backward step of a sequence-parallel MLP on N CPU ranks
(default 2; ``--world-size 4``), each rank holding x [S/N, H], w1 [H, F/N], w2 [F/N, H]::

    h = all_gather(x)  ->  relu(h @ w1) @ w2  ->  reduce_scatter(., "sum")

so forward and backward each hold one all-gather → matmul and one matmul → reduce-scatter.
Variants, all compiled in the same run on the same ranks: ``inductor`` (Inductor alone),
``inductor-reorder`` (Inductor with ``reorder_for_compute_comm_overlap = True``, given as the
compile's Inductor options, so Dynamo does not reuse plain Inductor's code, and patched with
``torch._inductor.config.patch`` around every call, which covers the lazy backward compile), and ``backend="commfuse"`` with ``schedule`` = ``slicing``, ``ring``,
``bidirectional`` and ``auto`` (what ``auto`` decided is read from ``commfuse_compile.reports()``
and printed; under the ``cpu-gloo`` profile it may leave everything alone). Two parts are timed
alongside them: ``compute-only`` (the same MLP on the full [S, H] input, no collectives,
Inductor) and ``comm-only`` (eager all-gather + reduce-scatter + reduce-scatter + all-gather of
the same tensors, as forward + backward issue them); ``max(compute, comm)`` is the ideal a
perfect overlap could reach, and each variant's "saving" is the fraction of
``T_inductor - ideal`` it achieved.

How. Every variant is compiled and warmed up first (untimed); then ``--rounds`` rounds each run
``--steps`` steps of every variant, round-robin, the order rotated every round so no variant
always follows the same one. Ranks pass a barrier before every timed step; rank 0 times the step
(its result needs every rank's contribution, so it ends about when the slowest rank's part
does). Medians over all timed steps. One torch thread per rank (``OMP_NUM_THREADS=1``): 2 ranks
on 2 cores; with ``--world-size 4`` ranks share cores (the sizing accounts for it, the timings
include the OS scheduler). Each run compiles into its own ``TORCHINDUCTOR_CACHE_DIR`` (a
tempdir) shared by its variants, so a later variant reuses identical kernels: the printed
compile seconds are not comparable between variants.

Network. Plain loopback gloo costs CPU, not wall time: on 2 cores the transfer competes with the
matmuls and overlap cannot show (REFERENCE §2). So when ``unshare -n`` works (root) the script
re-executes itself in a private network namespace whose loopback is shaped by a token bucket
(``tc qdisc add dev lo root tbf rate RATE burst 512kb latency 100ms``, default 400mbit ≈ 50 MB/s
shared by all ranks): communication then takes wall time at a few % CPU. Otherwise (or with
``--no-shape``) it runs on plain loopback and says so in the output and the JSON.

Sizes. S and H are set so the compute takes about ``--compute-ms`` per step at the matmul rate
measured here, and F so that the communication takes about ``--comm-ratio`` (0.5) of the
compute at RATE: fw + bw is 12·S·H·F/N FLOP per rank, and 2 all-gathers moving (N−1)·S·H·4
bytes in all over the one shaped link plus 2 reduce-scatters (gloo's take about twice as long
as its all-gathers here). The sizes and the resulting estimates are printed.

Caveat on the ideal. ``comm-only`` times gloo's collectives; a commfuse ring moves (N−1)/N of
the tensor per rank, the volume of a ring collective, which for the reduce-scatter is about
half of what gloo's took here, so a ring schedule can come in under ``max(compute, comm)`` (a
saving above 100%).

Usage: ``python benchmarks/step_time.py [--world-size 4] [--rate 400mbit] [--json out.json]``;
``--quick`` runs tiny sizes (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from _common import (
    format_table,
    machine_info,
    median,
    progress,
    rank_environment,
    run_ranks,
    script_command,
    site_dict,
    write_json,
)

VARIANTS = ("inductor", "inductor-reorder", "slicing", "ring", "bidirectional", "auto")
COMMFUSE_SCHEDULES = ("slicing", "ring", "bidirectional", "auto")

# Set in the re-executed child that runs inside the private network namespace.
NETNS_ENV = "COMMFUSE_BENCH_NETNS"

# Communication of one fw+bw step in units of one all-gather of [S, H]: 2 all-gathers and 2
# reduce-scatters, and gloo's reduce-scatter takes 2x its all-gather (measured here at 400mbit:
# [1280, 512] fp32 over 2 ranks, all-gather 50 ms, reduce-scatter 102 ms; 4 ranks likewise).
GATHER_EQUIVALENTS = 6

# Tiny sizes for --quick: a smoke test of the machinery, not a measurement.
QUICK_SIZES = {"S": 64, "H": 32, "F": 64}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return 0 on success (the process exit status)."""
    args = parse_args(argv)
    if args.shape and NETNS_ENV not in os.environ:
        if _can_unshare():
            return _rerun_in_namespace(sys.argv[1:] if argv is None else list(argv))
        network = {"shaped": False, "note": "unshare -n failed (not root?): plain loopback, communication competes with compute for CPU"}
    elif args.shape:
        network = _shape_loopback(args.rate)
    else:
        network = {"shaped": False, "note": "--no-shape: plain loopback, communication competes with compute for CPU"}
    progress(f"network: {'shaped ' + args.rate if network['shaped'] else 'NOT shaped'} ({network['note']})")
    try:
        results = run(args, network)
    except RuntimeError as err:
        print(f"step_time failed: {err}", file=sys.stderr)
        return 1
    print(render(results))
    write_json(args.json, results)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--rate", default="400mbit", help="token-bucket rate of the shaped loopback (tc syntax, default 400mbit)")
    parser.add_argument("--no-shape", dest="shape", action="store_false", help="plain loopback: no network namespace, no shaping")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; 2 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant per round (default 3; 1 with --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant after its compile (default 2)")
    parser.add_argument("--compute-ms", type=float, default=400.0, help="target compute time of one fw+bw step (default 400)")
    parser.add_argument("--comm-ratio", type=float, default=0.5, help="target communication / compute time (default 0.5)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--chunks-per-rank", type=int, default=None, help="commfuse chunks_per_rank for the fixed schedules (default: theirs)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds of 1 step: a smoke test")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2: one rank has nothing to communicate")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.steps is None:
        args.steps = 1 if args.quick else 3
    if args.quick:
        args.warmup = min(args.warmup, 1)
    return args


# --- network namespace -----------------------------------------------------------------------


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


def _rerun_in_namespace(argv: list[str]) -> int:
    """Run this script again, with the same arguments, inside a new network namespace."""
    progress("re-running inside a private network namespace (unshare -n)")
    env = {**os.environ, NETNS_ENV: "1"}
    # The child finds _common through its own directory, not through our sys.path.
    return subprocess.run(["unshare", "-n", *script_command(__file__, argv)], env=env).returncode


def _shape_loopback(rate: str) -> dict[str, Any]:
    """Bring up lo in this (private) namespace and put a token-bucket qdisc on it."""
    up = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if up.returncode != 0:
        raise SystemExit(f"cannot bring up loopback in the network namespace: {up.stderr.strip()}")
    tbf = ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, "burst", "512kb", "latency", "100ms"]
    shaped = subprocess.run(tbf, capture_output=True, text=True)
    if shaped.returncode != 0:
        return {"shaped": False, "note": f"tc failed ({shaped.stderr.strip()}): plain loopback in a private namespace"}
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout.strip()
    return {"shaped": True, "rate": rate, "note": f"private network namespace, {shown}"}


def rate_bytes_per_second(rate: str) -> float:
    """A tc rate ("400mbit", "1gbit", "50mbps", "1000000") in bytes per second."""
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "bit": 1 / 8, "bps": 1.0}
    text = rate.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text) / 8  # tc reads a bare number as bits per second


# --- sizes -----------------------------------------------------------------------------------


def matmul_flops_per_second() -> float:
    """Single-thread fp32 matmul rate of this machine, median of a few [512, 1024] @ [1024, 1024]."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
        a @ b
        times = []
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return 2 * 512 * 1024 * 1024 / median(times)
    finally:
        torch.set_num_threads(threads)


def plan_sizes(world_size: int, bytes_per_second: float, flops: float, compute_ms: float, comm_ratio: float) -> dict[str, Any]:
    """S, H, F such that fw+bw compute ≈ ``compute_ms`` and communication ≈ ``comm_ratio`` of it.

    Per rank fw + bw is 12·S·H·F/N FLOP (6 matmuls of S·H·F/N multiply-adds). An all-gather
    moves (N−1)·S·H·4 bytes in all over the one shaped loopback that all ranks share; gloo's
    reduce-scatter took twice as long as the all-gather of the same tensor here, so a step's
    2 + 2 collectives count as 6 all-gathers. Ranks beyond the core count share cores, so each
    computes at ``flops``·cores/N.
    """
    n = world_size
    per_rank = flops * min(1.0, (os.cpu_count() or 1) / n)
    comm_per_sh = GATHER_EQUIVALENTS * (n - 1) * 4 / bytes_per_second  # seconds per unit of S·H
    # comm = ratio · compute  <=>  comm_per_sh = ratio · 12·F / (N · per_rank)
    f = _round_up(comm_per_sh * n * per_rank / (12 * comm_ratio), 16 * n)
    h = 512
    sh = compute_ms / 1e3 * n * per_rank / (12 * f)
    s = _round_up(sh / h, 32 * n)  # per-rank rows divide by every small m and K
    return {
        "S": s,
        "H": h,
        "F": f,
        "matmul_flops_per_rank": per_rank,
        "link_bytes_per_second": bytes_per_second,
        "estimated_compute_ms": 12 * s * h * f / n / per_rank * 1e3,
        "estimated_comm_ms": comm_per_sh * s * h * 1e3,
    }


def _round_up(value: float, quantum: int) -> int:
    return max(quantum, int(-(-value // quantum)) * quantum)


# --- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, network: dict[str, Any]) -> dict[str, Any]:
    """Size the model, run every variant on fresh ranks, and assemble the results."""
    n = args.world_size
    if args.quick:
        sizes = {"S": QUICK_SIZES["S"] * n // 2, "H": QUICK_SIZES["H"], "F": QUICK_SIZES["F"] * n}
    else:
        progress("measuring the single-thread matmul rate")
        # Unshaped: size as if shaped at the default rate (the output says it is not shaped).
        rate = rate_bytes_per_second(args.rate if network["shaped"] else "400mbit")
        sizes = plan_sizes(n, rate, matmul_flops_per_second(), args.compute_ms, args.comm_ratio)
    progress(
        f"sizes: S={sizes['S']} H={sizes['H']} F={sizes['F']} (per rank x [{sizes['S'] // n}, {sizes['H']}], "
        f"w1 [{sizes['H']}, {sizes['F'] // n}], w2 [{sizes['F'] // n}, {sizes['H']}])"
        + (
            f"; estimated compute {sizes['estimated_compute_ms']:.0f} ms, comm {sizes['estimated_comm_ms']:.0f} ms per step"
            if "estimated_compute_ms" in sizes
            else ""
        )
    )
    config = {
        "S": sizes["S"],
        "H": sizes["H"],
        "F": sizes["F"],
        "variants": args.variants,
        "chunks_per_rank": args.chunks_per_rank,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    cache_dir = tempfile.mkdtemp(prefix="commfuse_step_time_")
    try:
        per_rank = run_ranks(rank_main, n, (config,), env=rank_environment(cache_dir))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return assemble(args, network, sizes, per_rank[0])


def assemble(args: argparse.Namespace, network: dict[str, Any], sizes: dict[str, Any], rank0: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios to Inductor and the fraction of the possible saving, from rank 0's times."""
    times = rank0["times_ms"]
    compute, comm = median(times["compute-only"]), median(times["comm-only"])
    ideal = max(compute, comm)
    base = median(times["inductor"]) if "inductor" in times else None
    variants = {}
    for name in args.variants:
        t = median(times[name])
        variants[name] = {
            "median_ms": t,
            "min_ms": min(times[name]),
            "times_ms": times[name],
            "ratio_to_inductor": t / base if base else None,
            "saving_fraction": (base - t) / (base - ideal) if base is not None and base > ideal else None,
            "compile_s": rank0["compile_s"][name],
            "sites": rank0["sites"].get(name),
        }
    return {
        "benchmark": "step_time",
        "machine": machine_info(),
        "network": network,
        "shaped": network["shaped"],
        "world_size": args.world_size,
        "quick": args.quick,
        "sizes": sizes,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "warmup": args.warmup,
        "variants": variants,
        "parts": {"compute_ms": compute, "comm_ms": comm, "ideal_ms": ideal, "compute_times_ms": times["compute-only"], "comm_times_ms": times["comm-only"]},
        "possible_saving_ms": base - ideal if base is not None else None,
    }


def render(results: dict[str, Any]) -> str:
    """The results table and the parts, as printed on stdout."""
    rows = []
    for name, v in results["variants"].items():
        rows.append([name, v["median_ms"], v["min_ms"], _ratio(v["ratio_to_inductor"]), _percent(v["saving_fraction"]), v["compile_s"], _sites(v["sites"])])
    parts = results["parts"]
    n, s = results["world_size"], results["sizes"]
    lines = [
        "",
        f"step time, fw+bw, world size {n}, S={s['S']} H={s['H']} F={s['F']}, "
        f"{'shaped loopback ' + results['network'].get('rate', '') if results['shaped'] else 'UNSHAPED loopback'}, "
        f"{results['rounds']} rounds x {results['steps_per_round']} steps, rank 0",
        format_table(["variant", "median ms", "min ms", "vs inductor", "saving", "compile s", "commfuse sites"], rows, left=(0, 6)),
        f"compute alone {parts['compute_ms']:.1f} ms, communication alone {parts['comm_ms']:.1f} ms, "
        f"ideal max(compute, comm) {parts['ideal_ms']:.1f} ms"
        + _possible_saving(results["possible_saving_ms"]),
    ]
    auto = results["variants"].get("auto")
    if auto and auto["sites"]:
        lines.append("auto decided:")
        lines.extend(f"  {site['graph']} {site['pattern']}: {_decision(site)}" for site in auto["sites"])
    return "\n".join(lines)


def _possible_saving(ms: float | None) -> str:
    if ms is None:
        return ""
    if ms <= 0:
        return f"; inductor is already within the ideal ({-ms:.1f} ms below it): nothing to save"
    return f", possible saving vs inductor {ms:.1f} ms"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _sites(sites: list[dict[str, Any]] | None) -> str:
    if sites is None:
        return "-"
    done = [s for s in sites if s["action"] == "rewritten"]
    kinds = sorted({f"{s['schedule']}(m={s['chunks_per_rank']})" for s in done})
    return f"{len(done)}/{len(sites)} rewritten" + (f" {' '.join(kinds)}" if kinds else "")


def _decision(site: dict[str, Any]) -> str:
    if site["action"] == "rewritten":
        return f"{site['schedule']} m={site['chunks_per_rank']}"
    return f"left alone ({site['reason']})"


# --- on every rank ---------------------------------------------------------------------------


class SequenceParallelMLP(torch.nn.Module):
    """all_gather → relu(h @ w1) @ w2 → reduce_scatter, on this rank's shards."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, group: Any):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        h = funcol.all_gather_single(x, 0, self.group)
        return funcol.reduce_scatter_single(torch.relu(h @ self.w1) @ self.w2, "sum", 0, self.group)


class ComputeOnlyMLP(torch.nn.Module):
    """The same matmuls on the full [S, H] input, without collectives."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(h @ self.w1) @ self.w2


def rank_main(config: dict[str, Any]) -> dict[str, Any]:
    """On one rank: compile and warm up every variant, then time them round-robin."""
    import torch.distributed as dist

    import commfuse_compile

    rank, n = dist.get_rank(), dist.get_world_size()
    # Several compiled variants of the same forward: more entries than Dynamo's default limit.
    torch._dynamo.config.recompile_limit = 64
    s, h, f = config["S"], config["H"], config["F"]
    gen = torch.Generator().manual_seed(rank)
    w1 = torch.randn(h, f // n, generator=gen) / h**0.5
    w2 = torch.randn(f // n, h, generator=gen) / (f // n) ** 0.5
    x = torch.randn(s // n, h, generator=gen).requires_grad_()
    g = torch.randn(s // n, h, generator=gen)
    group = dist.group.WORLD

    steps: dict[str, Callable[[], None]] = {}
    compile_s: dict[str, float] = {}
    sites: dict[str, list[dict[str, Any]]] = {}
    for name in config["variants"]:
        model = SequenceParallelMLP(w1, w2, group)
        steps[name] = _variant_step(name, model, x, g, config["chunks_per_rank"])
        before = len(commfuse_compile.reports())
        compile_s[name] = _warm_up(name, steps[name], config["warmup"], rank)
        if name in COMMFUSE_SCHEDULES:
            sites[name] = [site_dict(site) for rep in commfuse_compile.reports()[before:] for site in rep.sites]
    steps["compute-only"] = _compute_only_step(w1, w2, s, h, gen)
    compile_s["compute-only"] = _warm_up("compute-only", steps["compute-only"], config["warmup"], rank)
    steps["comm-only"] = _comm_only_step(x.detach(), s, h, group)
    compile_s["comm-only"] = _warm_up("comm-only", steps["comm-only"], config["warmup"], rank)

    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(config["rounds"]):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate: no fixed predecessor
        for name in order:
            for _ in range(config["steps"]):
                dist.barrier()
                start = time.perf_counter()
                steps[name]()
                times[name].append((time.perf_counter() - start) * 1e3)
        if rank == 0:
            progress(f"round {r + 1}/{config['rounds']}: " + ", ".join(f"{k} {median(v):.1f}" for k, v in times.items()) + " ms")
    dist.barrier()
    return {"times_ms": times, "compile_s": compile_s, "sites": sites}


def _variant_step(name: str, model: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, chunks: int | None) -> Callable[[], None]:
    """One fw+bw step of ``model`` compiled as variant ``name``."""
    import torch._inductor.config as inductor_config

    context: Callable[[], Any] = contextlib.nullcontext
    if name == "inductor":
        compiled = torch.compile(model, backend="inductor")
    elif name == "inductor-reorder":
        # As options too: Dynamo reuses the compiled code of an equal Inductor backend (same
        # options), so without them this variant would silently run the plain Inductor graphs.
        flag = {"reorder_for_compute_comm_overlap": True}
        compiled = torch.compile(model, backend="inductor", options=flag)
        # And patched around every call: backward compiles lazily, during the first .backward().
        context = functools.partial(inductor_config.patch, flag)
    else:
        options: dict[str, Any] = {"schedule": name}
        if chunks is not None and name != "auto":
            options["chunks_per_rank"] = chunks
        compiled = torch.compile(model, backend="commfuse", options=options)

    def step() -> None:
        x.grad = None
        for p in model.parameters():
            p.grad = None
        with context():
            compiled(x).backward(g)

    return step


def _compute_only_step(w1: torch.Tensor, w2: torch.Tensor, s: int, h: int, gen: torch.Generator) -> Callable[[], None]:
    model = ComputeOnlyMLP(w1, w2)
    compiled = torch.compile(model, backend="inductor")
    full = torch.randn(s, h, generator=gen).requires_grad_()
    grad = torch.randn(s, h, generator=gen)

    def step() -> None:
        full.grad = None
        for p in model.parameters():
            p.grad = None
        compiled(full).backward(grad)

    return step


def _comm_only_step(x: torch.Tensor, s: int, h: int, group: Any) -> Callable[[], None]:
    """The collectives of one fw+bw step, eagerly: AG(x), RS(y), RS(dh), AG(dout)."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    gathered, full = torch.empty(s, h), torch.randn(s, h)
    shard = torch.empty(s // n, h)

    def step() -> None:
        dist.all_gather_single(gathered, x, group=group)
        dist.reduce_scatter_single(shard, full, group=group)
        dist.reduce_scatter_single(shard, full, group=group)
        dist.all_gather_single(gathered, x, group=group)

    return step


def _warm_up(name: str, step: Callable[[], None], count: int, rank: int) -> float:
    """Run ``count`` untimed steps (the first compiles); return the first step's seconds."""
    import torch.distributed as dist

    if rank == 0:
        progress(f"compiling and warming up {name}")
    dist.barrier()
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    for _ in range(count - 1):
        step()
    return first


if __name__ == "__main__":
    sys.exit(main())
