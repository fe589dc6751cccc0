"""Sequence-parallel MLP compiled with ``backend="commfuse"``, checked against eager.

    python examples/tp_mlp.py [--world-size N]          # spawns N CPU ranks (gloo)
    torchrun --nproc-per-node N examples/tp_mlp.py      # one rank per process (NCCL on CUDA)

The demo lives in :mod:`commfuse_compile.demo` (``python -m commfuse_compile demo`` runs it
too): spawned ranks must import their entry point, and ``examples/`` is not a package.
"""

import sys

from commfuse_compile.demo import main

if __name__ == "__main__":  # spawned ranks re-import this file: only the launcher runs main
    sys.exit(main())
