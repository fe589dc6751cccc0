"""A pool of rank processes spawned once and reused by every test of a module.

Spawning a rank costs 3–5 s (import torch, rendezvous), so a test module starts its world once
and sends it work: ``pool.run(fn, *args)`` calls the module-level function ``fn(*args)`` on every
rank and returns the per-rank results, or raises with the failing rank's traceback. A rank that
does not answer within the timeout (a deadlocked ring, say) fails the test and the pool is torn
down, never left hanging.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, cache_dir: str, tasks: mp.Queue, results: mp.Queue) -> None:
    # Ranks share 2 cores: one thread each, no Inductor compile sub-processes.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHINDUCTOR_CACHE_DIR=cache_dir,  # shared: kernels compile once for all ranks
        TORCHINDUCTOR_COMPILE_THREADS="1",
        OMP_NUM_THREADS="1",
    )
    import warnings

    import torch
    import torch.distributed as dist

    # The toy programs use the (deprecated-named) funcol API on purpose: it is what users write.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*_functional_collectives.*")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, args = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args)))
        except BaseException:  # report everything, including assertion failures
            results.put((rank, False, traceback.format_exc()))
    # Drop Dynamo's references to the group first, or gloo's threads outlive it and can abort
    # the process at interpreter shutdown.
    torch._dynamo.reset()
    gc.collect()
    dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo ranks on this machine sharing one Inductor cache dir (the FX graph
    key covers the rank through the pass's uuid; identical kernels compile once)."""

    def __init__(self, world_size: int, cache_dir: str, timeout: float = 300.0):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.timeout = timeout
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, cache_dir, self.tasks[rank], self.results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Call ``fn(*args)`` on every rank; return the results indexed by rank."""
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args))
        results: list[Any] = [None] * self.world_size
        failures = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=self.timeout)
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(
                    f"{fn.__name__}: a rank did not answer within {self.timeout:.0f}s "
                    "(deadlocked ring?); the pool was torn down"
                ) from None
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
        if failures:
            raise AssertionError(f"{fn.__name__} failed\n" + "\n".join(failures))
        return results

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for proc in self.procs:
                proc.join(timeout=30)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
