"""Command line: ``python -m commfuse_compile <command>``.

Commands:
    demo    compile a sequence-parallel MLP with backend="commfuse" on N CPU ranks and compare
            it with eager (see :mod:`commfuse_compile.demo`).
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
    from commfuse_compile import demo

    demo_parser = commands.add_parser(
        "demo",
        help="compile a sequence-parallel MLP on N CPU ranks and compare it with eager",
        description=demo.DESCRIPTION,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":  # spawned ranks re-import this module: only the launcher runs main
    sys.exit(main())
