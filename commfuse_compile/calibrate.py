"""Measure the hardware profile ``auto`` plans with, on the job's own process group.

A named profile is a guess about a machine; the link a job really runs on may be ten times
slower or faster (a shared network, a shaped link, another interconnect), and ``auto`` then
rewrites where it loses or leaves alone what it would win. So with no ``profile`` option the
backend's first compile on a real process group measures what a profile assumes
(:func:`measure`) on the default (world) group, every rank at once; sites of a subgroup (TP
inside a larger job) plan with it too:

- the matmul rate of the device in fp32 and bf16 (square shapes), the efficiency of thin ones
  (``half_efficiency_dim``) and the fixed cost of a tiny one (``matmul_overhead``);
- the link to the ring neighbours as a ring step uses it — every rank sends to its successor
  and receives from its predecessor at once, through ``commfuse.ring_exchange`` — with a small
  message (``link_latency``: what one ring step costs beyond its bytes) and a large one
  (``link_bandwidth``: bytes/s in one direction, all ranks sending); and a tiny all-gather of
  the library's own (``collective_latency``: the plain collective's fixed cost per step, which
  on gloo is a fraction of a ring step's);
- whether both directions run at once (``duplex``: an exchange with both neighbours takes at
  most 1.5× one direction's time);
- the slowdown of a matmul while a large exchange is in flight (``overlap_slowdown``), and
  what a small exchange started before a matmul and waited for after it adds to the longer of
  the two alone (``step_overhead``: the host's share of a message, which no overlap hides).

The ranks then agree by one all-gather of their numbers, each rank reducing them alike (rates:
the slowest rank's; costs: the largest; the two figures timed beside a transfer, the ranks'
median: see :data:`TYPICAL`), so every rank plans with the same numbers, and the result is
cached on disk per machine, device, group layout and measuring method (:func:`cache_path`)
and reused by later runs, which then only agree on it.
The measurement costs 1.9 s over 2 gloo ranks and 4.1 s over 4 on a 1 Gbit/s link (2-core
CPU host; fifteen 4 MB exchanges, more time on a slower link); the logger reports it.
``python -m commfuse_compile calibrate`` measures ahead of time. A ``profile`` option still
wins; the fake process group and ``explain`` use the device's named profile.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .profiles import HardwareProfile

log = logging.getLogger("commfuse_compile")

# The fields measured, in the order of the agreeing all-gather. A ring runs at its slowest
# rank's pace, so rates are agreed as their minimum and costs as their maximum. The figures
# timed beside a transfer are agreed as the ranks' median: each comes from a window of a few
# matmuls, in which, where ranks share cores, one rank's share of the CPU swings twofold from
# window to window (per-rank slowdowns 0.6–2.5 on 4 ranks over 2 cores); a step's compute spans
# many windows and sees the typical share, and the largest of four such draws would price every
# ring step as the worst window (a slowdown of 2.1 where the ring ran 2× faster than Inductor).
RATES = ("flops_32bit", "flops_16bit", "link_bandwidth", "duplex")
COSTS = ("half_efficiency_dim", "matmul_overhead", "link_latency", "collective_latency")
TYPICAL = ("overlap_slowdown", "step_overhead")
FIELDS = RATES + COSTS + TYPICAL
METHOD = 3  # raised when what is measured, or how, changes (part of the cache key)
SMALL_BYTES, LARGE_BYTES = 4, 4 << 20
PROBE_DIM, LARGE_MATMUL_BUDGET_S = 256, 0.1  # (the peak-rate probe: see _measure_matmuls)
_measured: dict[str, HardwareProfile] = {}  # this process's profiles, by cache key


def measured_profile(group: dist.ProcessGroup | None = None) -> HardwareProfile | None:
    """The profile of ``group`` (default: the world) as this process measured or cached it; on
    the first call every rank of the group must call it (it communicates). None where nothing
    can be measured: no process group, the fake one, or a group of one."""
    if not dist.is_initialized() or dist.get_backend(group) == "fake" or dist.get_world_size(group) < 2:
        return None
    key = cache_key(group)
    if key not in _measured:
        _measured[key] = _agreed(group, key)
    return _measured[key]


def _agreed(group: dist.ProcessGroup | None, key: str) -> HardwareProfile:
    """The cached profile where every rank has one, else a fresh measurement; agreed by all."""
    cached = _load(key)
    everyone_cached = _group_min(int(cached is not None), group)
    started = time.perf_counter()
    if everyone_cached and cached is not None:
        values, source = cached, f"measured earlier, cached in {cache_path(key)}"
    else:
        values, source = measure(group), "measured at the first compile"
    agreed = _reduce(values, group)
    profile = _profile(agreed, source, dist.get_world_size(group))
    if source.startswith("measured at"):
        _store(key, agreed)
        log.info("commfuse: measured the link and the device in %.2f s: %s (cached in %s)", time.perf_counter() - started, describe(profile), cache_path(key))
    return profile


def measure(group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """This rank's measurements (every rank of ``group`` must call it: the link is timed
    between ring neighbours). The fields of :class:`HardwareProfile` that ``auto`` depends on."""
    device = _device()
    values = _measure_matmuls(device, group)
    values.update(_measure_link(group, device))
    return values


def _measure_matmuls(device: torch.device, group: dist.ProcessGroup | None) -> dict[str, float]:
    big = 1024 if device.type == "cpu" else 4096

    # Every rank starts each matmul together, as the ranks of a step compute together: where
    # they share cores (more ranks than cores) the rate is the shared one, the rate a step's
    # compute runs at, whichever schedule it has.
    def rate(m: int, k: int, n: int, dtype: torch.dtype) -> float:
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        return 2 * m * k * n / _median_seconds(lambda: a @ b, device, barrier=group)

    def peak(dtype: torch.dtype) -> float:
        # A probe first: where a dtype has no fast kernels (bf16 on most CPUs: under 1 GFLOP/s)
        # one large matmul takes seconds, six of them most of a first compile. There the
        # probe's rate is the rate (emulated matmuls gain little from size); the large one is
        # timed only where it is quick. The decision is agreed, so every rank times the same.
        probe = rate(PROBE_DIM, PROBE_DIM, PROBE_DIM, dtype)
        return rate(big, big, big // 2, dtype) if _group_min(int(time_large_matmul(probe, big)), group) else probe

    peak32 = peak(torch.float32)
    peak16 = peak(torch.bfloat16)
    # Efficiency d / (d + h) at a thin dim d: h = d (peak / rate - 1), the median over a few d.
    thin = [d * max(peak32 / rate(d, big, big, torch.float32) - 1.0, 0.0) for d in (16, 64, 256)]
    one = torch.randn(1, 1, device=device)
    return {
        "flops_32bit": peak32,
        "flops_16bit": peak16,
        "half_efficiency_dim": max(statistics.median(thin), 1.0),
        "matmul_overhead": _median_seconds(lambda: one @ one, device, repeats=51),  # (a fixed cost: alone)
    }


def _measure_link(group: dist.ProcessGroup | None, device: torch.device) -> dict[str, float]:
    from .p2p import ring_exchange

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    name = group.group_name if group is not None else dist.group.WORLD.group_name
    after, before = (rank + 1) % n, (rank - 1) % n

    def one_way(nbytes: int) -> Callable[[], None]:
        sent = torch.zeros(max(nbytes // 4, 1), device=device)
        return lambda: torch.ops.commfuse.wait_exchange(ring_exchange(sent, after, before, name, 0), sent)

    def both_ways(nbytes: int) -> Callable[[], None]:
        forward, backward = torch.zeros(max(nbytes // 4, 1), device=device), torch.zeros(max(nbytes // 4, 1), device=device)

        def step() -> None:
            got = ring_exchange(forward, after, before, name, 1), ring_exchange(backward, before, after, name, 2)
            torch.ops.commfuse.wait_exchange(got[0], forward)
            torch.ops.commfuse.wait_exchange(got[1], backward)

        return step

    latency = _median_seconds(one_way(SMALL_BYTES), device, repeats=21, barrier=group)
    # The library's own collective has its own fixed cost per step (the plain path auto
    # compares with): a tiny all-gather, per its N − 1 steps.
    tiny, gathered = torch.zeros(1, device=device), torch.zeros(n, device=device)
    collective = _median_seconds(lambda: dist.all_gather_single(gathered, tiny, group=group), device, repeats=21, barrier=group) / (n - 1)
    large = _median_seconds(one_way(LARGE_BYTES), device, repeats=3, barrier=group)
    bandwidth = LARGE_BYTES / max(large - latency, 1e-9)
    duplex = _median_seconds(both_ways(LARGE_BYTES), device, repeats=3, barrier=group) <= 1.5 * large
    # Matmuls alone, then while the large exchange is in flight: as many as the exchange
    # lasts (the same count on every rank), with every rank computing at once in both, so that
    # ranks sharing cores slow each other alike and the ratio is the transfer's share alone.
    a, b = torch.randn(256, 1024, device=device), torch.randn(1024, 1024, device=device)
    count = _agreed_count(large / _median_seconds(lambda: a @ b, device, barrier=group), group)
    sent = torch.zeros(LARGE_BYTES // 4, device=device)

    def matmuls() -> float:
        started = time.perf_counter()
        for _ in range(count):
            a @ b
        return time.perf_counter() - started

    alone = busy = 0.0
    for _ in range(3):
        dist.barrier(group)
        alone += matmuls()
        dist.barrier(group)
        received = ring_exchange(sent, after, before, name, 3)
        busy += matmuls()
        torch.ops.commfuse.wait_exchange(received, sent)
    # A ring step beside a matmul: start a small exchange, the matmul, wait. What that adds to
    # the longer of the two alone is the step's cost no overlap hides.
    small = torch.zeros(SMALL_BYTES // 4, device=device)
    left, right = (a, b) if device.type == "cpu" else (torch.randn(4096, 4096, device=device),) * 2  # (a few ms)
    # Both timed with every rank starting together: ranks sharing cores (more ranks than
    # cores, as on a small CPU host) slow each other's matmuls alike in both.
    matmul_alone = _median_seconds(lambda: left @ right, device, repeats=11, barrier=group)

    def step() -> None:
        got = ring_exchange(small, after, before, name, 4)
        left @ right
        torch.ops.commfuse.wait_exchange(got, small)

    beside = _median_seconds(step, device, repeats=11, barrier=group)
    return {
        "link_latency": latency,
        "collective_latency": collective,
        "link_bandwidth": bandwidth,
        "duplex": float(duplex),
        "overlap_slowdown": max(busy / alone, 1.0),
        # (a link slower than the matmul leaves its latency exposed too: that is not the host's)
        "step_overhead": max(beside - max(matmul_alone, latency), 0.0),
    }


def time_large_matmul(probe_flops_per_s: float, big: int, budget_s: float = LARGE_MATMUL_BUDGET_S) -> bool:
    """Whether the large ``big x big x big/2`` matmul, at the probe's rate, takes at most
    ``budget_s`` (it is then timed for the peak rate; else the probe's rate stands)."""
    return big * big * big / max(probe_flops_per_s, 1.0) <= budget_s


def _agreed_count(count: float, group: dist.ProcessGroup | None) -> int:
    """``count`` rounded into [1, 32], the smallest of the group's (every rank runs as many)."""
    return _group_min(min(max(int(count), 1), 32), group)


def _group_min(value: int, group: dist.ProcessGroup | None) -> int:
    """The smallest of the group's ``value``s (a flag: 1 only where every rank has it)."""
    agreed = torch.tensor([value], device=_device())  # (nccl: on the GPU)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return int(agreed.item())


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5, barrier: dist.ProcessGroup | None | bool = False) -> float:
    """Median wall time of ``fn`` after one warm-up call; with ``barrier`` (a group, or None
    for the world) the ranks start each call together."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        if barrier is not False:
            dist.barrier(barrier)
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _reduce(values: dict[str, float], group: dist.ProcessGroup | None) -> dict[str, float]:
    """The group's agreed values, from one all-gather of every rank's, reduced alike on every
    rank: rates the slowest, costs the largest, the figures timed beside a transfer the median."""
    mine = torch.tensor([float(values[k]) for k in FIELDS], dtype=torch.float64, device=_device())
    everyone = torch.empty(dist.get_world_size(group) * len(FIELDS), dtype=torch.float64, device=mine.device)
    dist.all_gather_single(everyone, mine, group=group)  # (all_gather_into_tensor is deprecated in torch 2.13)
    return agree(everyone.view(-1, len(FIELDS)).cpu())


def agree(everyone: torch.Tensor) -> dict[str, float]:
    """The agreed values of the ranks' rows (fields as in ``FIELDS``)."""
    columns = dict(zip(FIELDS, everyone.T))
    agreed = {k: columns[k].min().item() for k in RATES}
    agreed.update({k: columns[k].max().item() for k in COSTS})
    # (the median; of an even count, the mean of the middle two)
    agreed.update({k: columns[k].quantile(0.5).item() for k in TYPICAL})
    return agreed


def _profile(values: dict[str, float], source: str, ranks: int) -> HardwareProfile:
    fields = {k: float(v) for k, v in values.items() if k != "duplex"}
    return HardwareProfile(name=f"measured({ranks} ranks)", source=source, duplex=bool(values["duplex"]), **fields)


def describe(profile: HardwareProfile) -> str:
    """One line: the measured numbers in the units people read."""
    return (
        f"matmul {profile.flops_32bit / 1e9:.0f} GFLOP/s fp32, {profile.flops_16bit / 1e9:.0f} bf16; "
        f"link {profile.link_bandwidth / 1e6:.0f} MB/s per direction, {profile.link_latency * 1e6:.0f} µs per ring step "
        f"({(profile.collective_latency or 0) * 1e6:.0f} µs per step of the plain collective), "
        f"{'duplex' if profile.duplex else 'one direction at a time'}; overlap slowdown {profile.overlap_slowdown:.2f}, "
        f"{profile.step_overhead * 1e6:.0f} µs per ring step beside compute"
    )


# --- the cache -------------------------------------------------------------------------------


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def cache_key(group: dist.ProcessGroup | None = None) -> str:
    """Machine, device, backend and group layout: what the measured numbers depend on; and
    how they were measured (``METHOD``: a profile measured another way is measured again)."""
    device = _device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return f"{socket.gethostname()}|{name}|{dist.get_backend(group)}|ranks={ranks}|torch={torch.__version__}|method={METHOD}"


def cache_path(key: str) -> pathlib.Path:
    """The file holding ``key``'s profile: under ``$COMMFUSE_CACHE_DIR`` (default
    ``~/.cache/commfuse``), named by a hash of the key."""
    root = pathlib.Path(os.environ.get("COMMFUSE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "commfuse")
    return root / f"profile-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _load(key: str) -> dict[str, float] | None:
    try:
        data = json.loads(cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key or set(data.get("values", {})) != set(FIELDS):
        return None
    return data["values"]


def _store(key: str, values: dict[str, float]) -> None:
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "values": values, "date": time.strftime("%Y-%m-%d %H:%M")}, indent=2))
        tmp.replace(path)  # (atomic: ranks of one machine write the same numbers)
    except OSError as err:
        log.warning("commfuse: could not cache the measured profile in %s (%s); the next run measures again", path, err)


@functools.cache
def _cpu_name() -> str:  # (read once: the cache key is built at every compile)
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def as_option(profile: HardwareProfile) -> dict[str, object]:
    """``profile`` as a ``profile`` option value (every field), for the cache key and reports."""
    return dataclasses.asdict(profile)
