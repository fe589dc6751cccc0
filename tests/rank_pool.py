"""A pool of rank processes started once and reused by every test of a module.

Starting a rank from scratch costs about 6 s of CPU (importing torch, Dynamo and Inductor), so ranks
are forked from a server process that imported those once (multiprocessing's ``forkserver``
with a preload list, one server per test process), and a test module starts its world once
and sends it work: ``pool.run(fn, *args)`` calls the module-level function ``fn(*args)`` on every
rank and returns the per-rank results, or raises with the failing rank's traceback. A rank that
dies (a crash: its exit code is reported) or does not answer within the timeout (a deadlocked
ring, say: every rank's Python stack is reported) fails that test only: the pool is torn down and
the next ``run`` spawns a fresh world, so one hang does not cost every later test its timeout.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import multiprocessing.util
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, cache_dir: str, stacks: str, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHINDUCTOR_CACHE_DIR=cache_dir,  # shared: kernels compile once for all ranks (read per use)
        COMMFUSE_CACHE_DIR=os.path.join(cache_dir, "commfuse"),  # (auto's measured profiles: this session's own)
        **RANK_ENVIRONMENT,
    )
    # A crash writes this rank's stack here, and so does SIGUSR1 (sent on a timeout).
    stack_file = open(stacks, "w")  # noqa: SIM115  (open for the life of the process)
    faulthandler.enable(stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, stack_file, all_threads=True)
    import warnings

    import torch
    import torch._inductor.config
    import torch.distributed as dist

    # The toy programs use the (deprecated-named) funcol API on purpose: it is what users write.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*_functional_collectives.*")
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # (the server imported Inductor's config)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:  # (RankPool.close)
            break
        module, name, args = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args)))
        except BaseException:  # report everything, including assertion failures
            results.put((rank, False, traceback.format_exc()))
    # Exit without a clean teardown of Dynamo, gloo and the interpreter (about 4 s for a pool
    # of 4 ranks, for nothing: the results came back, Inductor wrote its cache as it compiled);
    # multiprocessing's own exit work first, which releases the semaphores this process made
    # (what multiprocessing does when a process's target returns, minus the interpreter's exit)
    sys.stdout.flush()
    sys.stderr.flush()
    multiprocessing.util._exit_function()
    os._exit(0)


# Ranks share 2 cores: one thread each, no Inductor compile sub-processes. Set for the fork server
# too, so what torch reads at import time is what a rank started from scratch would read.
# TORCHINDUCTOR_VEC_ISA_OK: see conftest.py (the same for every test process).
RANK_ENVIRONMENT = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}


def _context() -> Any:
    """The forkserver context, its server started (once per process) with torch imported, and
    warm_compiler: the first-compile work every rank would do, done once."""
    from commfuse_compile._forkserver import forkserver_context

    return forkserver_context(["warm_compiler"], **RANK_ENVIRONMENT)


class RankPool:
    """``world_size`` gloo ranks on this machine sharing one Inductor cache dir (the FX graph
    key covers the rank through the pass's uuid; identical kernels compile once)."""

    def __init__(self, world_size: int, cache_dir: str, timeout: float = 300.0):
        self.world_size, self.cache_dir, self.timeout = world_size, cache_dir, timeout
        self.procs: list[mp.Process] = []
        self._spawn()

    def _spawn(self) -> None:
        ctx = _context()
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        self.stacks = [tempfile.mktemp(prefix=f"rank{rank}_", suffix=".stack") for rank in range(self.world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, self.cache_dir, self.stacks[rank], self.tasks[rank], self.results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Call ``fn(*args)`` on every rank; return the results indexed by rank."""
        if not self.procs:  # torn down by an earlier failure
            self._spawn()
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args))
        results: list[Any] = [None] * self.world_size
        failures, answered = [], 0
        deadline = time.monotonic() + self.timeout
        while answered < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=2.0)
            except queue.Empty:
                if dead := [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]:
                    self._fail(failures, f"{fn.__name__}: rank(s) died: " + ", ".join(f"rank {r} exit code {_exit(c)}" for r, c in dead))
                if time.monotonic() > deadline:
                    self._fail(failures, f"{fn.__name__}: a rank did not answer within {self.timeout:.0f}s (deadlocked ring?)", dump=True)
                continue
            answered += 1
            deadline = time.monotonic() + self.timeout  # (per answer: ranks finish one by one)
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
        if failures:
            raise AssertionError(f"{fn.__name__} failed\n" + "\n".join(failures))
        return results

    def _fail(self, failures: list[str], what: str, dump: bool = False) -> None:
        """Tear the pool down and raise ``what`` with the ranks' failures and stacks."""
        if dump:
            for proc in self.procs:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2.0)
        stacks = [f"rank {r} stack:\n{_tail(path)}" for r, path in enumerate(self.stacks) if _tail(path)]
        self.close(force=True)
        raise TimeoutError("\n".join([what + "; the pool was torn down (the next test respawns it)", *failures, *stacks]))

    def close(self, force: bool = False) -> None:
        """Stop the ranks; ``force``: kill them (a hung or dead world)."""
        if not self.procs:  # (already torn down by a failure)
            return
        if not force:
            for q in self.tasks:
                q.put(None)
            for proc in self.procs:
                proc.join(timeout=30)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        for q in [*self.tasks, self.results]:
            q.close()
        self.procs = []
        for path in self.stacks:
            if os.path.exists(path):
                os.remove(path)


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path) as f:
            return f.read()[-limit:]
    except OSError:
        return ""
