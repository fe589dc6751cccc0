"""Peak memory of matmul → reduce-scatter: the plain collective vs commfuse's schedules.

What is measured. The program ``reduce_scatter(x @ w, "sum", dim 0)`` with x [S, K] and
w [K, H] on every rank (a row-parallel layer's output: each rank holds a partial sum of the
full [S, H] product and keeps its S/N rows of the total), compiled forward-only with
``backend="commfuse"`` and ``schedule`` = ``off`` (vanilla: the full product, then the
collective), ``ring``, ``bidirectional`` and ``slicing``, at world size 2 on gloo ranks. Per
rank: how far the resident set rises above its level just before one call, at its peak during
the call.

How. Every schedule runs on fresh ranks (new processes, own ``TORCHINDUCTOR_CACHE_DIR``). Each
rank compiles and runs the program once (untimed, unmeasured), frees the result, passes a
barrier, records its RSS, resets the kernel's peak-RSS mark (``echo 5 > /proc/self/clear_refs``:
VmHWM and ``ru_maxrss`` restart from the current RSS), makes the measured call and reads VmHWM.
Where clear_refs cannot be written, it falls back to ``ru_maxrss`` minus the RSS before the
call, which reads 0 whenever the compile's own high-water mark is above the call's peak (the
JSON says which method ran).

Limits. RSS counts pages touched, at page granularity, for the whole process: gloo's buffers,
allocator caching and any freed-but-not-returned heap count too, and a short peak is counted
as fully as a long one. Tensors above glibc's mmap threshold (at most 32 MiB) come from mmap and
go back to the OS when freed, so at the default sizes (product 256 MiB) each big tensor is
visible; small sizes (``--quick``) are noise. Next to the measured numbers the analytic
expectation: vanilla holds the full product S·H·4 bytes; the ring holds one chunk's partial
product S/(N·m)·H·4 at a time, plus its private send copy and the receive buffer (~3 chunks);
slicing starts every slice's collective before waiting on any, so all K slices (the full
product) can be alive at once. Every schedule also allocates the output, S/N·H·4 bytes.
gloo's own buffers come on top: in a check at S=2048, K=64, H=8192 (product 64 MiB, 2 ranks)
while writing this, the measured rises were off 162, ring 96, slicing 128 MiB — vanilla about
64 MiB above its model.

Usage: ``python benchmarks/peak_memory.py [--S 8192 --K 256 --H 8192] [--json out.json]``;
``--quick`` runs tiny sizes (a smoke test).
"""

from __future__ import annotations

import argparse
import gc
import resource
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from _common import format_table, machine_info, progress, rank_environment, run_ranks, site_dict, write_json

SCHEDULES = ("off", "ring", "bidirectional", "slicing")
MIB = 1 << 20
PAGE = resource.getpagesize()
# Defaults of commfuse when chunks_per_rank is None: 1 piece per chunk for the rings, 4 slices.
DEFAULT_PIECES = {"ring": 1, "bidirectional": 1, "slicing": 4}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return 0 on success (the process exit status)."""
    args = parse_args(argv)
    sizes = {"S": args.S, "K": args.K, "H": args.H}
    progress(
        f"x [{args.S}, {args.K}] @ w [{args.K}, {args.H}] -> reduce_scatter over {args.world_size} ranks; "
        f"full product {args.S * args.H * 4 / MIB:.0f} MiB, one chunk {args.S // args.world_size * args.H * 4 / MIB:.0f} MiB"
    )
    measured = {}
    try:
        for schedule in args.schedules:
            progress(f"{schedule}: fresh ranks, compile, warm call, measured call")
            measured[schedule] = measure_schedule(schedule, sizes, args.world_size, args.chunks_per_rank)
            progress(f"  {schedule}: rank 0 peak +{measured[schedule][0]['peak_increase'] / MIB:.0f} MiB")
    except RuntimeError as err:
        print(f"peak_memory failed: {err}", file=sys.stderr)
        return 1
    results = assemble(args, sizes, measured)
    print(render(results))
    write_json(args.json, results)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--S", type=int, default=None, help="rows of x and of the product (default 8192)")
    parser.add_argument("--K", type=int, default=None, help="contraction dim (default 256)")
    parser.add_argument("--H", type=int, default=None, help="columns of w and of the product (default 8192)")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated subset of {','.join(SCHEDULES)}")
    parser.add_argument("--chunks-per-rank", type=int, default=None, help="commfuse chunks_per_rank (default: each schedule's own)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    args = parser.parse_args(argv)
    defaults = (512, 32, 1024) if args.quick else (8192, 256, 8192)
    for name, default in zip(("S", "K", "H"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = sorted(set(args.schedules) - set(SCHEDULES))
    if unknown:
        parser.error(f"unknown schedule(s) {unknown}; valid: {', '.join(SCHEDULES)}")
    if args.S % (args.world_size * 8):
        parser.error(f"--S must be a multiple of 8·world size ({8 * args.world_size})")
    return args


def measure_schedule(schedule: str, sizes: dict[str, int], world_size: int, chunks: int | None) -> list[dict[str, Any]]:
    """Peak-memory numbers of every rank for one schedule, on fresh ranks with a fresh cache."""
    cache_dir = tempfile.mkdtemp(prefix="commfuse_peak_memory_")
    try:
        return run_ranks(rank_main, world_size, (schedule, sizes, chunks), env=rank_environment(cache_dir))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def analytic_bytes(schedule: str, sizes: dict[str, int], world_size: int, chunks: int | None) -> dict[str, Any]:
    """The product bytes the schedule holds at once, by construction (see the module docstring)."""
    s, h, n = sizes["S"], sizes["H"], world_size
    product, output = s * h * 4, s // n * h * 4
    if schedule == "off":
        return {"product_held": product, "output": output, "model": "full product"}
    m = chunks or DEFAULT_PIECES[schedule]
    if schedule == "slicing":
        return {"product_held": product, "output": output, "model": f"{m} slices of {product // m / MIB:.0f} MiB, all in flight"}
    piece = s // (n * m) * h * 4
    return {"product_held": 3 * piece, "output": output, "model": f"~3 pieces of {piece / MIB:.0f} MiB (partial, send copy, receive)"}


def assemble(args: argparse.Namespace, sizes: dict[str, int], measured: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per schedule: every rank's numbers, rank 0's and the max over ranks, and the model."""
    schedules = {}
    for schedule, ranks in measured.items():
        schedules[schedule] = {
            "ranks": ranks,
            "peak_increase_rank0": ranks[0]["peak_increase"],
            "peak_increase_max": max(r["peak_increase"] for r in ranks),
            "analytic": analytic_bytes(schedule, sizes, args.world_size, args.chunks_per_rank),
            "sites": ranks[0]["sites"],
        }
    return {
        "benchmark": "peak_memory",
        "machine": machine_info(),
        "world_size": args.world_size,
        "sizes": sizes,
        "chunks_per_rank": args.chunks_per_rank,
        "quick": args.quick,
        "method": measured and next(iter(measured.values()))[0]["method"],
        "full_product_bytes": sizes["S"] * sizes["H"] * 4,
        "chunk_bytes": sizes["S"] // args.world_size * sizes["H"] * 4,
        "schedules": schedules,
    }


def render(results: dict[str, Any]) -> str:
    """The results table as printed on stdout."""
    rows = []
    for schedule, r in results["schedules"].items():
        model = r["analytic"]
        rows.append(
            [
                schedule,
                f"{r['peak_increase_rank0'] / MIB:.1f}",
                f"{r['peak_increase_max'] / MIB:.1f}",
                f"{(model['product_held'] + model['output']) / MIB:.0f}",
                model["model"],
                _sites(r["sites"]),
            ]
        )
    s = results["sizes"]
    head = (
        f"\npeak RSS increase during one forward call (MiB), x [{s['S']}, {s['K']}] @ w [{s['K']}, {s['H']}] -> "
        f"reduce_scatter, world size {results['world_size']}, method: {results['method']}"
    )
    headers = ["schedule", "rank 0", "max rank", "model (+output)", "model", "commfuse sites"]
    return "\n".join([head, format_table(headers, rows, left=(0, 4, 5))])


def _sites(sites: list[dict[str, Any]]) -> str:
    done = [s for s in sites if s["action"] == "rewritten"]
    if not done:
        return f"0/{len(sites)} rewritten" + (f" ({sites[0]['reason']})" if sites else "")
    return f"{len(done)}/{len(sites)} rewritten " + " ".join(sorted({f"{s['schedule']}(m={s['chunks_per_rank']})" for s in done}))


# --- on every rank ---------------------------------------------------------------------------


class MatmulReduceScatter(torch.nn.Module):
    """``reduce_scatter(x @ w, "sum", 0)`` over ``group``."""

    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        return funcol.reduce_scatter_single(x @ w, "sum", 0, self.group)


def rank_main(schedule: str, sizes: dict[str, int], chunks: int | None) -> dict[str, Any]:
    """On one rank: compile, warm call, then the measured call's peak RSS increase."""
    import torch.distributed as dist

    import commfuse_compile

    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(sizes["S"], sizes["K"], generator=gen)
    w = torch.randn(sizes["K"], sizes["H"], generator=gen)
    options: dict[str, Any] = {"schedule": schedule}
    if chunks is not None and schedule != "off":
        options["chunks_per_rank"] = chunks
    compiled = torch.compile(MatmulReduceScatter(dist.group.WORLD), backend="commfuse", options=options)
    commfuse_compile.clear_reports()
    with torch.no_grad():
        out = compiled(x, w)  # compiles; also the first run of every kernel
        sites = [site_dict(site) for report in commfuse_compile.reports() for site in report.sites]
        expected_shape = list(out.shape)
        del out
        gc.collect()
        dist.barrier()
        before = rss_bytes()
        method = "VmHWM after clear_refs" if reset_peak() else "ru_maxrss (peak mark not reset)"
        out = compiled(x, w)
        peak = peak_rss_bytes(method)
    dist.barrier()
    return {
        "rss_before": before,
        "peak": peak,
        "peak_increase": max(peak - before, 0),
        "method": method,
        "output_shape": expected_shape,
        "output_bytes": out.numel() * out.element_size(),
        "sites": sites,
    }


def rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process to its current RSS; False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes(method: str) -> int:
    """The peak resident set: VmHWM when the mark was reset, else ``ru_maxrss``."""
    if method.startswith("VmHWM"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    sys.exit(main())
