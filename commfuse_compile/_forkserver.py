"""The fork server that the test ranks and the benchmarks' processes are started from.

Starting a process from scratch costs a few CPU-seconds of imports (torch, Dynamo, Inductor,
commfuse). multiprocessing's ``forkserver`` imports them once, in a server process, and forks
every later process from it: as fresh as a spawned one (the server compiles nothing, has no
process group and no CUDA), without the imports.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.context
import multiprocessing.forkserver
import os
from collections.abc import Sequence
from unittest import mock

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "commfuse_compile", "commfuse_compile.passes"]


def forkserver_context(extra_preload: Sequence[str] = (), **environment: str) -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver context, its server started with :data:`PRELOAD` (and
    ``extra_preload``) imported, under ``environment`` (what torch reads at import time, such as
    ``OMP_NUM_THREADS``).

    There is one server per process: the first call starts it, and later calls get that same
    server whatever they pass. A forked process inherits the server's environment, not its
    parent's: set anything per process in the process itself.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *extra_preload])
    with mock.patch.dict(os.environ, environment):
        multiprocessing.forkserver.ensure_running()
    return ctx
