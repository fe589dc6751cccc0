"""Peak memory of one forward + backward step of the expert-parallel MoE layer: Inductor vs
commfuse's ``moe_ep`` pipeline.

What is measured. The ``moe`` layer of ``step_models.py`` (torchtitan's token dispatcher form:
count exchange, dispatch, permute, grouped experts, permute back, combine) compiled by Inductor
alone and with ``backend="commfuse"`` (``schedule="ring"``), at world size 2 on gloo ranks
(unshaped loopback: memory does not depend on the link). Per rank: how far the resident set
rises above its level just before one step, at its peak during the step (the method and its
limits: ``peak_memory.py``; RSS counts gloo's buffers and the allocator's cached pages too).
Each variant runs on fresh ranks with its own Inductor cache; one warm step first.

Usage: ``python benchmarks/moe_memory.py [--sizes S=6080,H=512,F=4480] [--skewed] [--json out.json]``;
``--quick`` runs tiny sizes (a smoke test).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
from _common import format_table, machine_info, progress, rank_environment, run_ranks, site_dict, write_json
from peak_memory import peak_rss_bytes, reset_peak, rss_bytes
from step_models import MoEWorkload

VARIANTS = ("inductor", "commfuse")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="S=6080,H=512,F=4480", help="S (tokens over all ranks), H, F (default: step_time.py's moe sizes at 1gbit here)")
    parser.add_argument("--skewed", action="store_true", help="half of every rank's tokens to the next rank")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes = {key: int(value) for key, value in (item.split("=") for item in args.sizes.split(","))}
    if args.quick:
        sizes = MoEWorkload(args.skewed).quick_sizes(2)
    measured = {}
    for variant in VARIANTS:
        progress(f"{variant}: compiling, one warm step, one measured step")
        cache_dir = tempfile.mkdtemp(prefix="commfuse_moe_memory_")
        try:
            measured[variant] = run_ranks(rank_main, 2, (variant, sizes, args.skewed), env=rank_environment(cache_dir))
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    results = {"benchmark": "moe_memory", "machine": machine_info(), "world_size": 2, "sizes": sizes, "skewed": args.skewed, "variants": measured}
    rows = [
        [variant, *(f"{r['peak_increase'] / 2**20:.0f}" for r in ranks), ranks[0]["method"]] for variant, ranks in measured.items()
    ]
    print(format_table(["variant", "rank 0 peak rise MiB", "rank 1 peak rise MiB", "method"], rows))
    write_json(args.json, results)
    return 0


def rank_main(variant: str, sizes: dict[str, int], skewed: bool) -> dict[str, Any]:
    """On one rank: compile, a warm step, then the measured step's peak RSS increase."""
    import torch.distributed as dist

    import commfuse_compile

    rank = dist.get_rank()
    model, x, g = MoEWorkload(skewed).build(sizes, rank, 2, dist.group.WORLD)
    if variant == "inductor":
        compiled = torch.compile(model, backend="inductor")
    else:
        compiled = torch.compile(model, backend="commfuse", options={"schedule": "ring"})
    commfuse_compile.clear_reports()

    def step() -> None:
        for t in (x, *model.parameters()):
            t.grad = None
        compiled(x).backward(g)

    step()
    sites = [site_dict(site) for report in commfuse_compile.reports() for site in report.sites]
    gc.collect()
    dist.barrier()
    before = rss_bytes()
    method = "VmHWM after clear_refs" if reset_peak() else "ru_maxrss (peak mark not reset)"
    step()
    peak = peak_rss_bytes(method)
    dist.barrier()
    return {"rss_before": before, "peak": peak, "peak_increase": max(peak - before, 0), "method": method, "sites": sites}


if __name__ == "__main__":
    sys.exit(main())
