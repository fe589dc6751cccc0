"""Helpers shared by the benchmarks: starting gloo ranks, machine info, tables, JSON.

The benchmarks are scripts (``python benchmarks/X.py``); they import this module as ``_common``
because the script's own directory is first on ``sys.path`` (the tests put it there too).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import platform
import queue
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

# Wall-clock start, handed to the benchmark's processes and re-executed children so that
# their progress lines count from the same moment.
T0 = "COMMFUSE_BENCH_T0"
os.environ.setdefault(T0, repr(time.time()))


def progress(message: str) -> None:
    """Print one progress line (seconds since the benchmark started) and flush it at once."""
    print(f"[{time.time() - float(os.environ[T0]):7.1f}s] {message}", flush=True)


def machine_info() -> dict[str, Any]:
    """CPU model, core count, GPU (where one is visible), Python / torch versions and the date,
    for the JSON results."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (NaN when there are none)."""
    return statistics.median(values) if values else float("nan")


def matmul_flops_per_second() -> float:
    """Single-thread fp32 matmul rate of this machine, median of a few [512, 1024] @ [1024, 1024]."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
        a @ b
        times = []
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return 2 * 512 * 1024 * 1024 / median(times)
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(cache_dir: str) -> dict[str, str]:
    """Environment of a benchmark rank: one thread, serial Inductor compiles, private cache."""
    return {
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": cache_dir,
        "COMMFUSE_CACHE_DIR": os.path.join(cache_dir, "commfuse"),  # (auto measures this run's link)
    }


def _context() -> Any:
    """The context the benchmarks' processes start from: forked from a server that imported
    torch once (one torch thread, serial Inductor compiles), each given its own environment
    (``env``) before its target runs. A forked process is as fresh as a spawned one for what
    the benchmarks measure: the server only imports modules."""
    from commfuse_compile._forkserver import forkserver_context

    return forkserver_context(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")


def _rank_entry(
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    target: Callable[..., Any],
    args: tuple,
    results: mp.Queue,
) -> None:
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning, message=".*_functional_collectives.*")
    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config

    # Inductor read TORCHINDUCTOR_COMPILE_THREADS at import; set the value too, to be sure.
    inductor_config.compile_threads = 1
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results.put((rank, True, target(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        shutdown_dist()


def shutdown_dist() -> None:
    """Drop Dynamo's references to the process group, then destroy it.

    Otherwise gloo's threads can outlive the group and abort the process at interpreter
    shutdown (see ``commfuse_compile.demo._shutdown``).
    """
    import gc

    import torch
    import torch.distributed as dist

    torch._dynamo.reset()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    target: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    env: dict[str, str] | None = None,
    timeout: float = 1800.0,
) -> list[Any]:
    """Run the module-level function ``target(*args)`` on ``world_size`` fresh gloo ranks.

    Each rank is a new process (forked from a server that imported torch) with one torch
    thread, ``env`` set before ``target`` runs, and an initialised default process group. Returns the
    per-rank results; raises ``RuntimeError`` with the failing rank's traceback, or when a rank
    does not answer within ``timeout`` seconds (its peers are then killed, never left hanging).
    """
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(rank, world_size, port, {T0: os.environ[T0], **(env or {})}, target, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    answers: list[Any] = [None] * world_size
    failures = []
    try:
        for _ in range(world_size):
            rank, ok, value = _next_result(results, procs, timeout)
            if ok:
                answers[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
                break  # its peers may now wait forever in a collective
    finally:
        for proc in procs:
            proc.join(timeout=30 if not failures else 1)
            if proc.is_alive():
                proc.kill()
    if failures:
        raise RuntimeError("\n".join(failures))
    return answers


def _process_entry(env: dict[str, str], target: Callable[..., Any], args: tuple, results: mp.Queue) -> None:
    os.environ.update(env)
    try:
        results.put((True, target(*args)))
    except BaseException:
        results.put((False, traceback.format_exc()))


def run_process(target: Callable[..., Any], args: tuple = (), env: dict[str, str] | None = None, timeout: float = 1800.0) -> Any:
    """Run the module-level function ``target(*args)`` in a fresh process; return its result.

    ``env`` is set in the process before ``target`` runs. Raises ``RuntimeError`` with the traceback if
    ``target`` raised, or if it did not answer within ``timeout`` seconds (it is then killed).
    """
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_process_entry, args=({T0: os.environ[T0], **(env or {})}, target, args, results), daemon=True)
    proc.start()
    try:
        ok, value = _next_result(results, [proc], timeout)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if not ok:
        raise RuntimeError(value)
    return value


def _next_result(results: mp.Queue, procs: Sequence[Any], timeout: float) -> Any:
    """The next answer on ``results``; raises if a process died without one, or on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            pass
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            codes = ", ".join(f"pid {p.pid}: exit code {p.exitcode}" for p in dead)
            raise RuntimeError(f"a process died without answering ({codes}; -9 is SIGKILL, e.g. out of memory)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer within {timeout:.0f}s")


def run_and_keep_code(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()`` and the wrapper code of every graph Inductor generated while it ran. Unlike
    ``torch._inductor.utils.run_and_get_code`` it does not reset Dynamo first: that reset drops
    every other variant's compiled code, which then compiles again inside the timed rounds."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        result = fn()
    return result, codes


def schedule_of(code: str) -> list[str]:
    """The order a generated wrapper issues its collectives, waits and kernels in, by op name
    (buffer and kernel numbers left out): two compiles whose lists are equal ran the same
    schedule. Used to check that a peer's setting changed something."""
    import re

    order = []
    for line in code.split("\n"):
        line = line.strip()
        if line.startswith(("#", "def ", "async_compile", "from ", "import ")):
            continue
        if found := re.search(r"_c10d_functional\.(\w+)\.default\(", line):
            order.append(found.group(1))
        elif found := re.search(r"extern_kernels\.(\w+)\(", line):
            order.append(found.group(1))
        elif re.match(r"cpp_fused_\w+\(|triton_\w+\.run\(", line):
            order.append("kernel")
    return order


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left: Sequence[int] = (0,)) -> str:
    """A plain text table: the columns numbered in ``left`` left-aligned, the others right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i in left else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    return "\n".join([line(headers), "-" * len(line(headers)), *(line(r) for r in cells)])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.1f}"
    return str(value)


def run_and_report(name: str, run: Callable[..., dict[str, Any]], render: Callable[[dict[str, Any]], str], *args: Any, json_path: str | None) -> int:
    """``run(*args)``, its results printed by ``render`` and written to ``json_path``; the exit
    status (1, with the error on stderr, where a rank failed)."""
    try:
        results = run(*args)
    except RuntimeError as err:
        print(f"{name} failed: {err}", file=sys.stderr)
        return 1
    print(render(results))
    write_json(json_path, results)
    return 0


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as indented JSON (nothing when ``path`` is None)."""
    if path is None:
        return
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    print(f"results written to {path}", flush=True)


def script_command(script: str, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``script`` with ``argv`` in a new Python process."""
    return [sys.executable, os.path.abspath(script), *argv]


def site_dict(site: Any) -> dict[str, Any]:
    """A commfuse SiteRecord as JSON: what was decided and why, with the model's estimates."""
    return {
        "graph": site.graph,
        "pattern": site.pattern,
        "action": site.action,
        "schedule": site.schedule,
        "chunks_per_rank": site.chunks_per_rank,
        "reason": site.reason,
        "estimates": dict(site.estimates),
    }
