"""Command line: ``python -m commfuse_compile <command>``.

Commands:
    demo      compile a sequence-parallel MLP with backend="commfuse" on N CPU ranks and compare
              it with eager (see :mod:`commfuse_compile.demo`).
    explain   what the backend does to a model, in one process at any world size.
    simulate  model one matmul + collective under every schedule on a hardware profile.
    bench     run one of the benchmarks in benchmarks/.
    calibrate measure what auto assumes about the link and the device, and cache it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; return its exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m commfuse_compile",
        description="commfuse: a torch.compile backend overlapping all-gather / reduce-scatter with matmuls.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    # Import lazily: the demo pulls in torch.distributed and spawns processes.
    from commfuse_compile import commands as cmd
    from commfuse_compile import demo

    for name, help_, description, add, run in [
        ("demo", "compile a sequence-parallel MLP on N CPU ranks and compare it with eager", demo.DESCRIPTION, demo.add_arguments, demo.run),
        ("explain", "what the backend does to a model, at any world size, in one process", cmd.EXPLAIN, cmd.add_explain_arguments, cmd.run_explain),
        ("simulate", "model a matmul + collective under every schedule", cmd.SIMULATE, cmd.add_simulate_arguments, cmd.run_simulate),
        ("bench", "run a benchmark from benchmarks/", cmd.BENCH, cmd.add_bench_arguments, cmd.run_bench),
        ("calibrate", "measure the link and the device for auto, and cache it", cmd.CALIBRATE, cmd.add_calibrate_arguments, cmd.run_calibrate),
    ]:
        sub = commands.add_parser(name, help=help_, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
        add(sub)
        sub.set_defaults(run=run)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":  # spawned ranks re-import this module: only the launcher runs main
    sys.exit(main())
