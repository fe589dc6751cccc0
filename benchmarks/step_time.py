"""Step time of a parallel layer on real gloo ranks: Inductor vs commfuse's schedules.

What is measured. One forward + backward step of a layer (``--model``, see ``step_models.py``)
on N CPU ranks (default 2; ``--world-size 4``):

- ``mlp`` (default): a sequence-parallel MLP, each rank holding x [S/N, H], w1 [H, F/N],
  w2 [F/N, H]: ``h = all_gather(x) -> relu(h @ w1) @ w2 -> reduce_scatter(., "sum")``, so
  forward and backward each hold one all-gather → matmul and one matmul → reduce-scatter;
- ``ulysses``: a Ulysses attention layer, x [S/N, H] and four replicated [H, H] weights: the
  q / k / v projections each all-to-all'd to head groups, causal attention over the whole
  sequence, an all-to-all back and the output projection (4 all-to-alls forward, 4 backward).

Variants, all compiled in the same run on the same ranks: ``inductor`` (Inductor alone),
``inductor-reorder`` (Inductor with ``reorder_for_compute_comm_overlap = True`` and the overlap
passes its config recommends, without which the flag runs nothing in torch 2.13; given as the
compile's Inductor options, so Dynamo does not reuse plain Inductor's code, and patched with
``torch._inductor.config.patch`` around every call, which covers the lazy backward compile; its
generated code is compared with plain Inductor's, and the output says whether the passes changed
the order of collectives, waits and kernels: ``peer_checks``), and
``backend="commfuse"`` with ``schedule`` = ``slicing``, ``ring``, ``bidirectional`` and ``auto``
(for ``ulysses`` only ``ring`` and ``auto``: an all-to-all has the ring schedule alone). What
``auto`` decided is read from ``commfuse_compile.reports()`` and printed; under the ``cpu-gloo``
profile it may leave everything alone. Two parts are timed alongside them: ``compute-only``
(the same compute without collectives, Inductor) and ``comm-only`` (the step's collectives,
eagerly, on tensors of the same sizes); ``max(compute, comm)`` is the ideal a perfect overlap
could reach, and each variant's "saving" is the fraction of ``T_inductor - ideal`` it achieved.

How. Every variant is compiled and warmed up first (untimed), then timed side by side
(``_rounds.py``: settling rounds until every variant's step is within ``--settle`` (5%) of its
step in the round before, at most ``--settle-rounds``, 10; then ``--rounds`` rounds of
``--steps`` steps of every variant, round-robin, rotated). Medians over all timed steps. One torch thread per rank (``OMP_NUM_THREADS=1``): 2 ranks
on 2 cores; with ``--world-size 4`` ranks share cores (the sizing accounts for it, the timings
include the OS scheduler). Each run compiles into its own ``TORCHINDUCTOR_CACHE_DIR`` (a
tempdir) shared by its variants, so a later variant reuses identical kernels: the printed
compile seconds are not comparable between variants.

Network. On loopback in a private network namespace shaped by a token bucket (``_network.py``;
default 400mbit ≈ 50 MB/s shared by all ranks, 1gbit for ``ulysses``). Without ``unshare -n``
(or with ``--no-shape``) it runs on plain loopback and says so in the output and the JSON.

Sizes. Unless ``--sizes`` fixes them (to compare runs: the measured matmul rate varies by a
quarter between runs here), each layer is sized so that its compute takes about ``--compute-ms`` per step at the
matmul rate measured here and its communication about ``--comm-ratio`` (0.5) of the compute at
RATE (``step_models.py`` says how); the sizes and the resulting estimates are printed.

Caveat on the ideal. ``comm-only`` times gloo's collectives; a commfuse ring moves (N−1)/N of
the tensor per rank, the volume of a ring collective, which for the reduce-scatter is about
half of what gloo's took here, so a ring schedule can come in under ``max(compute, comm)`` (a
saving above 100%).

Usage: ``python benchmarks/step_time.py [--model ulysses] [--world-size 4] [--rate 400mbit] [--json out.json]``;
``--quick`` runs tiny sizes (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _common import (
    format_table,
    machine_info,
    matmul_flops_per_second,
    median,
    progress,
    rank_environment,
    run_and_keep_code,
    run_and_report,
    run_ranks,
    schedule_of,
    site_dict,
)
from _network import enter_network, rate_bytes_per_second
from _rounds import settle, timed_rounds
from step_models import WORKLOADS

VARIANTS = ("inductor", "inductor-reorder", "slicing", "ring", "bidirectional", "auto")
# Inductor's recommended overlap passes (torch/_inductor/config.py, above the option).
REORDER_PASSES = ("reorder_communication_preserving_peak_memory", "sink_waits_iterative", "reorder_communication_preserving_peak_memory")
REORDER_PEER = {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": list(REORDER_PASSES)}
PEERS = {"inductor-reorder": "inductor"}  # peer variant: the variant its setting must change
COMMFUSE_SCHEDULES = ("slicing", "ring", "bidirectional", "auto")



def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return 0 on success (the process exit status)."""
    args = parse_args(argv)
    network = enter_network(__file__, sys.argv[1:] if argv is None else list(argv), args.shape, args.rate)
    if isinstance(network, int):  # (ran inside a private network namespace: its exit status)
        return network
    progress(f"network: {'shaped ' + args.rate if network['shaped'] else 'NOT shaped'} ({network['note']})")
    return run_and_report("step_time", run, render, args, network, json_path=args.json)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="mlp", help="the layer timed (default mlp; see step_models.py)")
    parser.add_argument("--rate", default=None, help="token-bucket rate of the shaped loopback (tc syntax; default 400mbit for mlp, 1gbit for ulysses)")
    parser.add_argument("--no-shape", dest="shape", action="store_false", help="plain loopback: no network namespace, no shaping")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; 2 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant per round (default 3; 1 with --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant after its compile (default 2)")
    parser.add_argument("--settle", type=float, default=0.05, help="settled when every variant's untimed step is within this fraction of its last (default 0.05)")
    parser.add_argument("--settle-rounds", type=int, default=None, help="at most this many untimed settling rounds (default 10; 0 with --quick)")
    parser.add_argument("--compute-ms", type=float, default=400.0, help="target compute time of one fw+bw step (default 400)")
    parser.add_argument("--comm-ratio", type=float, default=0.5, help="target communication / compute time (default 0.5)")
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)} (default: all that apply to the model)")
    parser.add_argument("--chunks-per-rank", type=int, default=None, help="commfuse chunks_per_rank for the fixed schedules (default: theirs)")
    parser.add_argument("--sizes", default=None, help="fixed sizes instead of planned ones, e.g. S=832,H=512,F=12960 (to compare runs)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds of 1 step: a smoke test")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2: one rank has nothing to communicate")
    workload = WORKLOADS[args.model]
    args.rate = args.rate or workload.default_rate
    args.variants = list(workload.variants) if args.variants is None else [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(workload.variants))
    if unknown:
        parser.error(f"variant(s) {unknown} do not apply to --model {args.model}; valid: {', '.join(workload.variants)}")
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.steps is None:
        args.steps = 1 if args.quick else 3
    if args.settle_rounds is None:
        args.settle_rounds = 0 if args.quick else 10
    if args.quick:
        args.warmup = min(args.warmup, 1)
    return args


# --- the run ---------------------------------------------------------------------------------


def _given_sizes(text: str) -> dict[str, int]:
    """``--sizes S=832,H=512`` as a dict; a clear error for anything else."""
    sizes = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if not key or not value.strip().isdigit():
            raise SystemExit(f"--sizes: {item!r} is not NAME=INTEGER (e.g. --sizes S=832,H=512,F=12960)")
        sizes[key.strip()] = int(value)
    return sizes


def run(args: argparse.Namespace, network: dict[str, Any]) -> dict[str, Any]:
    """Size the model, run every variant on fresh ranks, and assemble the results."""
    n, workload = args.world_size, WORKLOADS[args.model]
    if args.quick:
        sizes = workload.quick_sizes(n)
    elif args.sizes:
        sizes = _given_sizes(args.sizes)
    else:
        progress("measuring the single-thread matmul rate")
        # Unshaped: size as if shaped at the rate asked for (the output says it is not shaped).
        sizes = workload.plan_sizes(n, rate_bytes_per_second(args.rate), matmul_flops_per_second(), args.compute_ms, args.comm_ratio)
    progress(
        f"{args.model} sizes: {workload.describe(sizes, n)}"
        + (
            f"; estimated compute {sizes['estimated_compute_ms']:.0f} ms, comm {sizes['estimated_comm_ms']:.0f} ms per step"
            if "estimated_compute_ms" in sizes
            else ""
        )
    )
    config = {
        "model": args.model,
        "sizes": {k: sizes[k] for k in ("S", "H", "F") if k in sizes},
        "variants": args.variants,
        "chunks_per_rank": args.chunks_per_rank,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "settle": args.settle,
        "settle_rounds": args.settle_rounds,
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
            "max_ms": max(times[name]),
            "times_ms": times[name],
            "ratio_to_inductor": t / base if base else None,
            "saving_fraction": (base - t) / (base - ideal) if base is not None and base > ideal else None,
            "compile_s": rank0["compile_s"][name],
            "sites": rank0["sites"].get(name),
        }
    return {
        "benchmark": "step_time",
        "model": args.model,
        "machine": machine_info(),
        "network": network,
        "shaped": network["shaped"],
        "world_size": args.world_size,
        "quick": args.quick,
        "sizes": sizes,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "warmup": args.warmup,
        "settling_rounds_ms": rank0["settling_rounds_ms"],
        "round_medians_ms": rank0["round_medians_ms"],
        "variants": variants,
        "parts": {"compute_ms": compute, "comm_ms": comm, "ideal_ms": ideal, "compute_times_ms": times["compute-only"], "comm_times_ms": times["comm-only"]},
        "possible_saving_ms": base - ideal if base is not None else None,
        "peer_checks": rank0["peer_checks"],
    }


def render(results: dict[str, Any]) -> str:
    """The results table and the parts, as printed on stdout."""
    rows = []
    for name, v in results["variants"].items():
        rows.append([name, v["median_ms"], v["min_ms"], v["max_ms"], _ratio(v["ratio_to_inductor"]), _percent(v["saving_fraction"]), v["compile_s"], _sites(v["sites"])])
    parts = results["parts"]
    n, s = results["world_size"], results["sizes"]
    shape = " ".join(f"{k}={s[k]}" for k in ("S", "H", "F") if k in s)
    lines = [
        "",
        f"step time, {results['model']}, fw+bw, world size {n}, {shape}, "
        f"{'shaped loopback ' + results['network'].get('rate', '') if results['shaped'] else 'UNSHAPED loopback'}, "
        f"{results['rounds']} rounds x {results['steps_per_round']} steps, rank 0, after "
        f"{len(results['settling_rounds_ms'])} untimed settling rounds "
        f"({', '.join(f'{t:.0f}' for t in results['settling_rounds_ms'])} ms)",
        format_table(["variant", "median ms", "min ms", "max ms", "vs inductor", "saving", "compile s", "commfuse sites"], rows, left=(0, 7)),
        f"compute alone {parts['compute_ms']:.1f} ms, communication alone {parts['comm_ms']:.1f} ms, "
        f"ideal max(compute, comm) {parts['ideal_ms']:.1f} ms"
        + _possible_saving(results["possible_saving_ms"]),
    ]
    auto = results["variants"].get("auto")
    if auto and auto["sites"]:
        lines.append("auto decided:")
        lines.extend(f"  {site['graph']} {site['pattern']}: {_decision(site)}" for site in auto["sites"])
    for peer, check in results.get("peer_checks", {}).items():
        verdict = f"changed the order in {check['graphs_changed']} of {check['graphs']} graphs" if check["changed"] else "changed NOTHING (the row is plain Inductor)"
        lines.append(f"{peer}: its setting {verdict} of the generated code, against {check['versus']}")
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


def rank_main(config: dict[str, Any]) -> dict[str, Any]:
    """On one rank: compile and warm up every variant, then time them round-robin."""
    import torch.distributed as dist

    import commfuse_compile

    rank, n = dist.get_rank(), dist.get_world_size()
    # Several compiled variants of the same forward: more entries than Dynamo's default limit.
    torch._dynamo.config.recompile_limit = 64
    workload, sizes, group = WORKLOADS[config["model"]], config["sizes"], dist.group.WORLD

    steps: dict[str, Callable[[], None]] = {}
    compile_s: dict[str, float] = {}
    sites: dict[str, list[dict[str, Any]]] = {}
    codes: dict[str, list[str]] = {}
    for name in config["variants"]:
        model, x, g = workload.build(sizes, rank, n, group)
        steps[name] = _variant_step(name, model, x, g, config["chunks_per_rank"])
        before = len(commfuse_compile.reports())
        kept = codes if name in PEERS or name in PEERS.values() else None
        compile_s[name] = _warm_up(name, steps[name], config["warmup"], rank, kept)
        if name in COMMFUSE_SCHEDULES:
            sites[name] = [site_dict(site) for rep in commfuse_compile.reports()[before:] for site in rep.sites]
    steps["compute-only"] = workload.compute_only(sizes, rank, n)
    compile_s["compute-only"] = _warm_up("compute-only", steps["compute-only"], config["warmup"], rank)
    steps["comm-only"] = workload.comm_only(sizes, n, group)
    compile_s["comm-only"] = _warm_up("comm-only", steps["comm-only"], config["warmup"], rank)

    settling = settle(steps, config["settle"], config["settle_rounds"], rank)
    times, round_medians = timed_rounds(steps, config["rounds"], config["steps"], rank)
    return {
        "times_ms": times,
        "compile_s": compile_s,
        "sites": sites,
        "settling_rounds_ms": settling,
        "round_medians_ms": round_medians,
        "peer_checks": peer_checks(codes),
    }


def peer_checks(codes: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """For each peer variant compiled beside its base: whether its setting changed the order
    of collectives, waits and kernels in the generated code, graph by graph."""
    checks = {}
    for peer, base in PEERS.items():
        if peer in codes and base in codes:
            changed = [schedule_of(a) != schedule_of(b) for a, b in zip(codes[peer], codes[base])]
            checks[peer] = {"versus": base, "graphs": len(changed), "graphs_changed": sum(changed), "changed": any(changed)}
    return checks


def _variant_step(name: str, model: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, chunks: int | None) -> Callable[[], None]:
    """One fw+bw step of ``model`` compiled as variant ``name``."""
    import torch._inductor.config as inductor_config

    context: Callable[[], Any] = contextlib.nullcontext
    if name == "inductor":
        compiled = torch.compile(model, backend="inductor")
    elif name == "inductor-reorder":
        # As options too: Dynamo reuses the compiled code of an equal Inductor backend (same
        # options), so without them this variant would silently run the plain Inductor graphs.
        # The flag alone runs no pass in torch 2.13 (its pass list defaults to []): the list is
        # the one Inductor's config.py recommends.
        flag = REORDER_PEER
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


def _warm_up(name: str, step: Callable[[], None], count: int, rank: int, codes: dict[str, list[str]] | None = None) -> float:
    """Run ``count`` untimed steps (the first compiles); return the first step's seconds. With
    ``codes``, the first step's generated code is kept there under ``name``."""
    import torch._inductor.config as inductor_config
    import torch.distributed as dist

    if rank == 0:
        progress(f"compiling and warming up {name}")
    dist.barrier()
    start = time.perf_counter()
    if codes is None:
        step()
    else:
        with inductor_config.patch(fx_graph_cache=False):  # (a cache hit generates no code to read)
            _, codes[name] = run_and_keep_code(step)
    first = time.perf_counter() - start
    for _ in range(count - 1):
        step()
    return first


if __name__ == "__main__":
    sys.exit(main())
