"""Measure this machine for the ``cpu-gloo`` cost-model profile.

Runs two gloo ranks on loopback, one thread each (as the tests do), and measures:

* matmul FLOP/s in fp32 and bf16 on square and thin shapes -> ``flops_32bit``,
  ``flops_16bit``, ``half_efficiency_dim`` (fitted to d / (d + h)) and ``matmul_overhead``;
* point-to-point latency (a 4-byte message) and bandwidth (a 16 MB message), one way ->
  ``link_latency``, ``link_bandwidth``;
* the slowdown of a matmul while a large transfer is in flight -> ``overlap_slowdown``.

Prints every measurement and the resulting profile as a dict that ``options={"profile": ...}``
accepts. Usage: ``python benchmarks/calibrate_cpu_profile.py``. Medians of repeated runs.

Measured on the development machine (2 cores, 2026-11-30), the numbers in ``cpu-gloo``:
fp32 1024² matmul 82.7 GFLOP/s, bf16 256² 176 GFLOP/s; thin fp32 [d, 1024] @ [1024, 1024]:
24.1 / 59.0 / 77.7 / 88.6 GFLOP/s at d = 4 / 16 / 64 / 256 (h ≈ 5.3); a 1×1 matmul 1.2 µs;
one-way latency 64 µs, 16 MB in 6.39 ms (2.65 GB/s); a matmul while 64 MB arrive: no
measurable slowdown (1.0).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def median_seconds(fn, repeats: int = 7) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rate(d_small: int, d: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(d_small, d, dtype=dtype), torch.randn(d, d, dtype=dtype)
    return 2 * d_small * d * d / median_seconds(lambda: a @ b)


def p2p_seconds(rank: int, nbytes: int) -> float:
    buf = torch.zeros(max(nbytes // 4, 1))

    def ping_pong():
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return median_seconds(ping_pong) / 2  # one way


def worker(rank: int, port: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = {}
    if rank == 0:
        for dtype, name in [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]:
            size = 1024 if dtype == torch.float32 else 256
            result[f"{name}_square_flops"] = matmul_rate(size, size, dtype)
        result["fp32_thin_flops"] = {d: matmul_rate(d, 1024, torch.float32) for d in (4, 16, 64, 256)}
        a = torch.randn(1, 1)
        result["matmul_overhead"] = median_seconds(lambda: a @ a, repeats=101)
    dist.barrier()
    result["latency"] = p2p_seconds(rank, 4)
    result["one_way_16MB"] = p2p_seconds(rank, 16 << 20)
    # Overlap: rank 0 times a matmul alone, then while rank 1 streams 64 MB to it.
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    dist.barrier()
    if rank == 0:
        alone = median_seconds(lambda: a @ b)
        buf = torch.zeros(16 << 20)
        work = dist.irecv(buf, 1)
        start = time.perf_counter()
        for _ in range(5):  # 5 matmuls while 64 MB arrive (gloo moves it on its own threads)
            a @ b
        busy = (time.perf_counter() - start) / 5
        work.wait()
        result["overlap_slowdown"] = max(busy / alone, 1.0)
    else:
        dist.send(torch.zeros(16 << 20), 0)
    dist.barrier()
    out.put((rank, result))
    dist.destroy_process_group()


def main() -> None:
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    r = results[0]
    thin = r["fp32_thin_flops"]
    peak = r["fp32_square_flops"]
    # efficiency d / (d + h) = rate / peak  ->  h = d (peak / rate - 1); median over the thin shapes
    half = statistics.median(max(d * (peak / rate - 1), 0.0) for d, rate in thin.items())
    bandwidth = (16 << 20) / max(r["one_way_16MB"] - r["latency"], 1e-9)
    print(json.dumps({k: v for k, v in r.items()}, indent=2, default=float))
    profile = dict(
        base="cpu-gloo",
        flops_32bit=peak,
        flops_16bit=r["bf16_square_flops"],
        half_efficiency_dim=max(half, 1.0),
        matmul_overhead=r["matmul_overhead"],
        link_bandwidth=bandwidth,
        link_latency=r["latency"],
        overlap_slowdown=r["overlap_slowdown"],
    )
    print("measured on", os.uname().nodename, time.strftime("%Y-%m-%d"), "(1 thread per rank, gloo, loopback)")
    print("profile =", json.dumps(profile, indent=2))


if __name__ == "__main__":
    main()
