"""Whole-model step time: torchtitan trained as its trainer trains, commfuse beside its peers.

What is measured. One training step — forward, torchtitan's loss, backward, grad clipping and
AdamW — of torchtitan 0.3.0's model (``--model``) on N gloo ranks (``--world-size``, 2 or 4),
built and parallelized by torchtitan's own ``parallelize_llama`` / ``parallelize_qwen3`` and
compiled per block (and the loss) as ``--compile.enable --compile.backend X`` does
(``tests/titan_trainer.py``, no activation checkpointing):

- ``llama3`` (default): Llama3 at ``--dim`` 768, ``--heads`` 12, 2 layers, vocab 2048, fp32,
  ``--batch`` 1 × ``--seq`` 1024 tokens, TP + SP over every rank (at 4 ranks TP 2 × FSDP 2
  with ``--tp 2``);
- ``qwen3``: dense Qwen3 at the same width (4 kv heads, FFN 2048, tied embeddings);
- ``qwen3_moe``: Qwen3 ``debugmodel_moe`` (dim 256, 8 experts of 768, top 2), TP + SP with
  expert parallelism over the TP ranks (``partial_dtensor``): its experts compute in bf16.

Variants, each its own model on the same ranks, compiled with its own backend name (so Dynamo
never hands one variant's code to another) and timed side by side:

- ``inductor``: Inductor alone;
- ``inductor-reorder``: Inductor with ``reorder_for_compute_comm_overlap`` and the passes its
  config recommends (the flag alone runs nothing in torch 2.13);
- ``inductor-overlap``: Inductor's overlap scheduler
  (``aten_distributed_optimizations.enable_overlap_scheduling``) with analytical runtime
  estimates on CPU (``_overlap_peer.py``: its own estimates need a GPU), the link priced at
  the first rate;
- ``commfuse``: the backend named with no options, as a torchtitan user writes it (``auto``);
- ``ring`` / ``bidirectional``: commfuse with that fixed schedule.

For each peer the generated code is compared with plain Inductor's and the output says whether
its setting changed the order of collectives, waits and kernels (``peer_checks``). Two parts are
timed alongside: ``comm-only`` replays the step's collectives, one after the other, each
waited for, on buffers of the same sizes (recorded from one eager step of the Inductor model:
the compiled graphs issue the same ones); ``comm-ring`` moves their bytes as a ring moves them,
through commfuse's transport (:func:`ring_transfers`); ``compute-only``
runs the Inductor model's step on a fake process group of the same world size (collectives are
free there; rank 0 only, after the gloo ranks finish). ``max(compute, min(comm-only,
comm-ring))`` is the ideal a perfect overlap could reach (at tiny sizes the ring's per-step
latency makes the replay the faster way), and each variant's "saving" is the fraction of
``T_inductor - ideal`` it achieved.

Where the time goes. After its timed rounds at each rate every variant runs three more steps
under the profiler on every rank, the median one kept (``_breakdown.py``), and compute alone
the same: the step's time sorted into parts (waiting for transfers, the eager collectives between the compiled graphs,
starting transfers, matmuls, attention, compiled kernels, ...) and the trainer's phases
(forward, loss, backward, grad clipping, optimizer) (``breakdowns``, ``compute_breakdown``).

Rates. The loopback is shaped (``_network.py``) at each of ``--rates`` in turn (default 1gbit
and 200mbit), the compiled variants kept: every rate gets its own settling and timed rounds
(``_rounds.py``). ``compute-only`` does not depend on the rate.

Usage: ``python benchmarks/model_step.py [--model llama3] [--world-size 2] [--rates 1gbit,200mbit]
[--json out.json]``; ``--quick`` runs a tiny model, 1 round of 1 step (a smoke test, not a
measurement).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _breakdown import BLOCKED, PARTS, profile_median_step
from _common import format_table, machine_info, matmul_flops_per_second, median, progress, rank_environment, run_and_keep_code, run_and_report, run_process, run_ranks, schedule_of, site_dict
from _network import enter_network, rate_bytes_per_second, shape_loopback
from _overlap_peer import overlap_scheduler_config
from _rounds import settle, timed_rounds

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # titan_trainer, clients

MODELS = ("llama3", "qwen3", "qwen3_moe")
VARIANTS = ("inductor", "inductor-reorder", "inductor-overlap", "commfuse", "ring", "bidirectional")
PEERS = ("inductor-reorder", "inductor-overlap")  # compared with "inductor"'s generated code
# Inductor's recommended overlap passes (torch/_inductor/config.py, above the option).
REORDER_PASSES = ("reorder_communication_preserving_peak_memory", "sink_waits_iterative", "reorder_communication_preserving_peak_memory")
REORDER_CONFIG = {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": list(REORDER_PASSES)}
COMMFUSE_OPTIONS = {"commfuse": None, "ring": {"schedule": "ring"}, "bidirectional": {"schedule": "bidirectional"}}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return 0 on success (the process exit status)."""
    args = parse_args(argv)
    network = enter_network(__file__, sys.argv[1:] if argv is None else list(argv), args.shape, args.rates[0])
    if isinstance(network, int):  # (ran inside a private network namespace: its exit status)
        return network
    progress(f"network: {'shaped' if network['shaped'] else 'NOT shaped'} ({network['note']})")
    return run_and_report("model_step", run, render, args, network, json_path=args.json)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama3", help="torchtitan model (default llama3)")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: every rank); FSDP over the rest")
    parser.add_argument("--rates", default="1gbit,200mbit", help="comma-separated loopback rates, each timed in turn (tc syntax; default 1gbit,200mbit)")
    parser.add_argument("--no-shape", dest="shape", action="store_false", help="plain loopback: no network namespace, no shaping")
    parser.add_argument("--dim", type=int, default=768, help="model width of llama3 / qwen3 (default 768)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads of llama3 / qwen3 (default 12)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank (default 1)")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per rate (default 5; 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant per round (default 3; 1 with --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant after its compile (default 2)")
    parser.add_argument("--settle", type=float, default=0.05, help="settled when every variant's step is within this fraction of its last (default 0.05)")
    parser.add_argument("--settle-rounds", type=int, default=None, help="at most this many settling rounds per rate (default 8; 0 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 round of 1 step: a smoke test")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2: one rank has nothing to communicate")
    args.tp = args.tp or args.world_size
    if args.world_size % args.tp:
        parser.error(f"--tp {args.tp} must divide --world-size {args.world_size}")
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if "inductor" not in args.variants:
        args.variants.insert(0, "inductor")  # (the baseline, and the comm-only recording)
    if args.quick:
        args.dim, args.heads, args.seq = 128, 4, 64
        args.warmup = min(args.warmup, 1)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    args.steps = args.steps if args.steps is not None else (1 if args.quick else 3)
    args.settle_rounds = args.settle_rounds if args.settle_rounds is not None else (0 if args.quick else 8)
    return args


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``titan_trainer.build``'s arguments for this run (the backend left out)."""
    kwargs: dict[str, Any] = {"tp": args.tp, "ac": None, "batch": args.batch, "seq": args.seq}
    if args.model == "qwen3_moe":
        kwargs.update(ep=args.tp, spmd_backend="partial_dtensor")
    else:
        kwargs.update(dim=args.dim, n_heads=args.heads)
    return kwargs


# --- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, network: dict[str, Any]) -> dict[str, Any]:
    """Time every variant at every rate on the gloo ranks, then compute alone; assemble."""
    config = {
        "model": args.model,
        "kwargs": model_kwargs(args),
        "variants": args.variants,
        "rates": args.rates if network["shaped"] else ["unshaped"],
        # (the overlap scheduler's estimates price the link at the first rate)
        "link_bytes_per_s": rate_bytes_per_second(args.rates[0]),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "settle": args.settle,
        "settle_rounds": args.settle_rounds,
    }
    progress(f"{args.model} at world size {args.world_size}: {config['kwargs']}")
    cache_dir = tempfile.mkdtemp(prefix="commfuse_model_step_")
    try:
        per_rank = run_ranks(rank_main, args.world_size, (config,), env=rank_environment(cache_dir), timeout=7200)
        progress("timing compute alone (Inductor, fake process group)")
        compute = run_process(compute_only_main, (config, args.world_size), env=rank_environment(cache_dir), timeout=3600)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return assemble(args, network, config, per_rank, compute)


def assemble(args: argparse.Namespace, network: dict[str, Any], config: dict[str, Any], per_rank: list[dict[str, Any]], compute_only: dict[str, Any]) -> dict[str, Any]:
    """Per rate: medians, ratios to Inductor, the fraction of the possible saving and where
    each variant's step went (rank 0's breakdown, and every rank's time blocked on transfers)."""
    rank0, compute_ms = per_rank[0], compute_only["times_ms"]
    compute = median(compute_ms)
    rates = {}
    for rate, times in rank0["times_ms"].items():
        comm, ring = median(times["comm-only"]), median(times["comm-ring"])
        ideal = max(compute, min(comm, ring))  # (the faster way to move the step's bytes)
        base = median(times["inductor"])
        variants = {}
        for name in config["variants"]:
            t = median(times[name])
            variants[name] = {
                "median_ms": t,
                "min_ms": min(times[name]),
                "max_ms": max(times[name]),
                "times_ms": times[name],
                "ratio_to_inductor": t / base,
                "saving_fraction": (base - t) / (base - ideal) if base > ideal else None,
            }
        rates[rate] = {
            "variants": variants,
            "comm_ms": comm,
            "comm_times_ms": times["comm-only"],
            "comm_ring_ms": ring,
            "comm_ring_times_ms": times["comm-ring"],
            "ideal_ms": ideal,
            "possible_saving_ms": base - ideal,
            "breakdowns": {
                name: {**parts, "blocked_per_rank_ms": [sum(r["breakdowns"][rate][name]["parts_ms"][p] for p in BLOCKED) for r in per_rank]}
                for name, parts in rank0["breakdowns"][rate].items()
            },
            "settling_rounds_ms": rank0["settling_rounds_ms"][rate],
            "round_medians_ms": rank0["round_medians_ms"][rate],
        }
    return {
        "benchmark": "model_step",
        "model": args.model,
        "model_kwargs": config["kwargs"],
        "machine": machine_info(),
        "network": network,
        "world_size": args.world_size,
        "quick": args.quick,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "compute_ms": compute,
        "compute_times_ms": compute_ms,
        "compute_breakdown": compute_only["breakdown"],
        "rates": rates,
        "compile_s": rank0["compile_s"],
        "sites": rank0["sites"],
        "collectives_per_step": rank0["collectives"],
        "collectives_as_ring_steps": rank0["collectives_as_ring_steps"],
        "measured_profiles": rank0["measured_profiles"],
        "peer_checks": rank0["peer_checks"],
    }


def render(results: dict[str, Any]) -> str:
    """One table per rate, the parts, what ``commfuse`` (auto) decided and the peer checks."""
    lines = [""]
    for rate, at in results["rates"].items():
        rows = [
            [name, v["median_ms"], v["min_ms"], v["max_ms"], f"{v['ratio_to_inductor']:.3f}", _percent(v["saving_fraction"]), _sites(results["sites"].get(name))]
            for name, v in at["variants"].items()
        ]
        lines += [
            f"step time, torchtitan {results['model']} {results['model_kwargs']}, world size {results['world_size']}, "
            f"loopback {rate}, {results['rounds']} rounds x {results['steps_per_round']} steps, rank 0, after "
            f"{len(at['settling_rounds_ms'])} settling rounds",
            format_table(["variant", "median ms", "min ms", "max ms", "vs inductor", "saving", "commfuse sites"], rows, left=(0, 6)),
            f"compute alone {results['compute_ms']:.1f} ms; communication alone: the {results['collectives_per_step']} collectives "
            f"as issued {at['comm_ms']:.1f} ms, their bytes as ring steps {at['comm_ring_ms']:.1f} ms; "
            f"ideal max(compute, the faster of the two) {at['ideal_ms']:.1f} ms, possible saving {at['possible_saving_ms']:.1f} ms",
            "",
            *_breakdown_table(results["compute_breakdown"], at["breakdowns"]),
        ]
    auto = results["sites"].get("commfuse")
    if auto:
        lines.append("commfuse (auto) decided:")
        lines.extend(f"  {s['graph']} {s['pattern']}: " + (f"{s['schedule']} m={s['chunks_per_rank']}" if s["action"] == "rewritten" else f"left alone ({s['reason']})") for s in auto)
    for peer, check in results["peer_checks"].items():
        verdict = f"changed the order in {check['graphs_changed']} of {check['graphs']} graphs" if check["changed"] else "changed NOTHING (the row is plain Inductor)"
        lines.append(f"{peer}: its setting {verdict} of the generated code, against inductor")
    return "\n".join(lines)


def _breakdown_table(compute: dict[str, Any], variants: dict[str, dict[str, Any]]) -> list[str]:
    """Rank 0's profiled step, part by part (ms), beside compute alone's."""
    columns = {"compute alone": compute, **variants}
    rows = [[part, *(c["parts_ms"][part] for c in columns.values())] for part in PARTS]
    rows.append(["step (profiled)", *(c["step_ms"] for c in columns.values())])
    phases = list(dict.fromkeys(name for c in columns.values() for name in c["phases"]))
    phase_rows = [[name, *(_phase_cell(c["phases"].get(name)) for c in columns.values())] for name in phases]
    blocked = ", ".join(f"{name} " + "/".join(f"{ms:.0f}" for ms in v["blocked_per_rank_ms"]) for name, v in variants.items())
    return [
        "where rank 0's median profiled step went (ms; _breakdown.py):",
        format_table(["part", *columns], rows, left=(0,)),
        format_table(["phase: ms (blocked)", *columns], phase_rows, left=(0,)),
        f"blocked on transfers (waiting + eager collectives) on each rank (ms): {blocked}",
        "",
    ]


def _phase_cell(phase: dict[str, float] | None) -> str:
    return "-" if phase is None else f"{phase['ms']:.1f} ({phase['waiting_ms']:.1f})"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _sites(sites: list[dict[str, Any]] | None) -> str:
    if sites is None:
        return "-"
    done = [s for s in sites if s["action"] == "rewritten"]
    return f"{len(done)}/{len(sites)} rewritten"


# --- on every rank ---------------------------------------------------------------------------


def rank_main(config: dict[str, Any]) -> dict[str, Any]:
    """On one rank: build and warm up every variant, record the step's collectives, then time
    the variants side by side at each rate (rank 0 reshapes the link between rates)."""
    import titan_trainer
    import torch.distributed as dist

    import commfuse_compile
    from commfuse_compile import calibrate

    rank = dist.get_rank()
    # Every variant compiles each block's forward and the loss once more: more entries per
    # code object than Dynamo's default limit allows.
    torch._dynamo.config.recompile_limit = 64
    _register_backends(config["link_bytes_per_s"])
    steps: dict[str, Callable[[], Any]] = {}
    compile_s: dict[str, float] = {}
    sites: dict[str, list[dict[str, Any]]] = {}
    codes: dict[str, list[str]] = {}
    trainings = {}
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        # (caches off: a graph served from a cache passes through no backend pass and
        # generates no code to compare)
        for name in config["variants"]:
            torch.manual_seed(0)
            training = titan_trainer.build(config["model"], backend_name(name), **config["kwargs"])
            trainings[name], steps[name] = training, training.step
            before = len(commfuse_compile.reports())
            if rank == 0:
                progress(f"compiling and warming up {name}")
            dist.barrier()
            start = time.perf_counter()
            _, codes[name] = run_and_keep_code(training.step)
            compile_s[name] = time.perf_counter() - start
            for _ in range(config["warmup"] - 1):
                training.step()
            if name in COMMFUSE_OPTIONS:
                sites[name] = [site_dict(site) for rep in commfuse_compile.reports()[before:] for site in rep.sites]
    calls = record_collectives(trainings["inductor"].step)
    steps["comm-only"] = lambda: replay(calls)
    steps["comm-ring"] = ring_transfers(calls)

    times, settling, round_medians, breakdowns = {}, {}, {}, {}
    for rate in config["rates"]:
        if rate != "unshaped":
            if rank == 0:
                shape_loopback(rate)
                progress(f"loopback shaped to {rate}")
            dist.barrier()
        settling[rate] = settle(steps, config["settle"], config["settle_rounds"], rank)
        times[rate], round_medians[rate] = timed_rounds(steps, config["rounds"], config["steps"], rank)
        breakdowns[rate] = {}
        for name in config["variants"]:
            # (every rank profiles the same steps together; each rank keeps its median step)
            breakdowns[rate][name] = profile_median_step(steps[name], before=dist.barrier)
    return {
        "breakdowns": breakdowns,
        "times_ms": times,
        "settling_rounds_ms": settling,
        "round_medians_ms": round_medians,
        "compile_s": compile_s,
        "sites": sites,
        "collectives": len(calls),
        "collectives_as_ring_steps": sum(_ring_of(func, args) is not None for func, args, _ in calls),
        # (what ``auto`` measured at its first compile and planned with)
        "measured_profiles": [calibrate.as_option(profile) for profile in calibrate._measured.values()],
        "peer_checks": {
            peer: _peer_check(codes[peer], codes["inductor"]) for peer in PEERS if peer in codes
        },
    }


def compute_only_main(config: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Rank 0's step of the Inductor-compiled model on a fake process group of ``world_size``
    ranks: the same compute, collectives free (their results are garbage: denormals are
    flushed so garbage does not slow the matmuls). Returns the timed steps (ms) and the
    breakdown of its median profiled step."""
    import titan_trainer

    import commfuse_compile

    torch.set_flush_denormal(True)
    with commfuse_compile.fake_world(world_size):
        training = titan_trainer.build(config["model"], "inductor", **config["kwargs"])
        if config["model"] == "qwen3_moe":
            _same_routing_everywhere(training.model)
        for _ in range(config["warmup"] + 2):
            training.step()
        times = []
        for _ in range(max(5, config["rounds"] * config["steps"])):
            start = time.perf_counter()
            training.step()
            times.append((time.perf_counter() - start) * 1e3)
        breakdown = profile_median_step(training.step)
    return {"times_ms": times, "breakdown": breakdown}


def _same_routing_everywhere(model: torch.nn.Module) -> None:
    """Under the fake group the token-count exchange returns garbage: every rank routes as
    this one (``tests/clients.py``'s stand-in), so the dispatch sizes agree with the input."""
    import types

    from clients import _same_routing_count_exchange
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if isinstance(dispatcher, AllToAllTokenDispatcher):
            dispatcher._token_count_exchange = types.MethodType(_same_routing_count_exchange, dispatcher)


# --- backends --------------------------------------------------------------------------------


def backend_name(variant: str) -> str:
    """The backend name ``variant`` compiles with: "inductor" and "commfuse" as users name them,
    the others registered by :func:`_register_backends`."""
    return variant if variant in ("inductor", "commfuse") else f"model_step_{variant.replace('-', '_')}"


def _register_backends(link_bytes_per_s: float) -> None:
    """A backend name of its own for each variant with settings: Dynamo keeps compiled code per
    backend, so a variant never runs another's code (an equal backend would share it)."""
    from torch._dynamo import register_backend
    from torch._inductor.compile_fx import compile_fx

    from commfuse_compile.backend import commfuse

    def inductor_with(patches: dict[str, Any]) -> Callable[..., Any]:
        # compile_fx applies config_patches to the lazily compiled backward too.
        return lambda gm, inputs: compile_fx(gm, inputs, config_patches=patches)

    register_backend(inductor_with(REORDER_CONFIG), name=backend_name("inductor-reorder"))
    overlap = overlap_scheduler_config(matmul_flops_per_second(), link_bytes_per_s)
    register_backend(inductor_with(overlap), name=backend_name("inductor-overlap"))
    for variant, options in COMMFUSE_OPTIONS.items():
        if options is not None:
            register_backend(lambda gm, inputs, options=options: commfuse(gm, inputs, options=options), name=backend_name(variant))


def _peer_check(peer: list[str], base: list[str]) -> dict[str, Any]:
    changed = [schedule_of(a) != schedule_of(b) for a, b in zip(peer, base)]
    return {"graphs": len(changed), "graphs_changed": sum(changed), "changed": any(changed)}


# --- communication alone ---------------------------------------------------------------------


# c10d ops that move nothing (wait and barrier) or are no collective (the autograd wrapper
# DTensor's functional all-reduce passes its result through).
NOT_COLLECTIVES = ("wait", "barrier", "_wrap_tensor_autograd")


def record_collectives(step: Callable[[], Any]) -> list[tuple[Any, tuple, dict]]:
    """The collectives one step issues, in order, each with buffers of its own of the same
    sizes (from one eager step under a dispatch mode: the compiled graphs were traced from that
    code and hold the same collectives; eager DTensor issues them as in-place ``c10d`` ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    calls: list[tuple[Any, tuple, dict]] = []

    def fresh(value: Any) -> Any:
        return torch.empty_like(value) if isinstance(value, torch.Tensor) else value

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if func.namespace in ("_c10d_functional", "c10d") and not any(word in func.__name__ for word in NOT_COLLECTIVES):
                calls.append((func, tree_map(fresh, args), tree_map(fresh, kwargs)))
            return func(*args, **kwargs)

    with torch.compiler.set_stance("force_eager"), Recorder():  # (compiled code refuses the mode)
        step()
    return calls


def ring_transfers(calls: list[tuple[Any, tuple, dict]]) -> Callable[[], None]:
    """The recorded collectives' bytes moved as a ring moves them (commfuse's own transport,
    each rank sending to its successor in the group while receiving from its predecessor):
    all-gather N−1 steps of the input block, reduce-scatter N−1 steps of the output block,
    all-reduce 2(N−1) steps of 1/N: the volume a ring schedule moves, beside the replay of the
    library's own collectives (the ideal takes the faster of the two); collectives of another
    kind are replayed as they are. Both spellings are read: the functional ops compiled graphs
    and DTensor's eager all-reduces issue, and the in-place ``c10d`` ops (``_allgather_base_``,
    ``_reduce_scatter_base_``, ``allreduce_``) that eager DTensor redistributes issue, which
    take the output first and a process group object instead of a group name."""
    from commfuse_compile.p2p import ring_exchange

    steps: list[Callable[[], None]] = []
    for func, args, kwargs in calls:
        ring = _ring_of(func, args)
        if ring is None:
            steps.append(lambda call=(func, args, kwargs): replay([call]))
            continue
        count, elements, dtype, group_name, n, rank = ring
        block = torch.empty(max(elements, 1), dtype=dtype)

        def exchange(block=block, count=count, n=n, rank=rank, group_name=group_name) -> None:
            for _ in range(count):
                torch.ops.commfuse.wait_exchange(ring_exchange(block, (rank + 1) % n, (rank - 1) % n, group_name, 0), block)

        steps.append(exchange)

    def transfer_all() -> None:
        for step in steps:
            step()

    return transfer_all


def _ring_of(func: Any, args: tuple) -> tuple[int, int, torch.dtype, str, int, int] | None:
    """(ring steps, elements per step, dtype, group name, group size, rank in it) for a recorded
    all-gather, reduce-scatter or all-reduce; None for any other collective."""
    import torch.distributed as dist

    from torch.distributed.distributed_c10d import _resolve_process_group

    name = func.__name__.split(".")[0]
    if func.namespace == "_c10d_functional" and name in FUNCTIONAL_RINGS:
        group_name = next((a for a in reversed(args) if isinstance(a, str) and a not in ("sum", "avg", "max", "min")), None)
        if group_name is None:
            return None
        group = _resolve_process_group(group_name)
        tensor, kind = args[0], FUNCTIONAL_RINGS[name]
    elif func.namespace == "c10d" and name in C10D_RINGS:
        kind, position = C10D_RINGS[name]
        group = dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject)))
        group_name = group.group_name
        tensor = args[position][0] if isinstance(args[position], list) else args[position]
    else:
        return None
    n, rank = group.size(), group.rank()
    # tensor: the gathered block, the scattered output block, or the whole tensor reduced
    count, elements = {
        "all_gather": (n - 1, tensor.numel()),
        "reduce_scatter": (n - 1, tensor.numel()),
        "reduce_scatter_whole": (n - 1, tensor.numel() // n),
        "all_reduce": (2 * (n - 1), tensor.numel() // n),
    }[kind]
    return count, elements, tensor.dtype, group_name, n, rank


# Each functional collective's ring kind; its first argument is the input (a reduce-scatter's
# whole tensor: each step moves 1/N of it).
FUNCTIONAL_RINGS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter_whole",
}
# Each in-place c10d collective's ring kind and which argument holds the block the kind reads
# (the all-gather's input, the reduce-scatter's output, the all-reduce's tensor list).
C10D_RINGS = {
    "_allgather_base_": ("all_gather", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 0),
    "allreduce_": ("all_reduce", 0),
}
# (an all-to-all is replayed: gloo's is pairwise already, and its blocks differ per rank)


def replay(calls: list[tuple[Any, tuple, dict]]) -> None:
    """Issue the recorded collectives one after the other, each waited for."""
    from torch.utils._pytree import tree_leaves

    for func, args, kwargs in calls:
        out = func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and func.namespace == "_c10d_functional":
                torch.ops._c10d_functional.wait_tensor(leaf)
            elif hasattr(leaf, "wait"):
                leaf.wait()


if __name__ == "__main__":
    sys.exit(main())
