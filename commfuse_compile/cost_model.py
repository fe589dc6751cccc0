"""Cost model: the modelled time of each schedule for one match, and ``auto``'s choice.

A match is described by a :class:`Workload` — its matmuls, which of their dims the chunks cut,
and the bytes of one rank's chunk — built from what every rank of the group shares (the
collective's shape and dtype, the group size; ``passes.plan.shared_matmul``), so every rank
of a group computes the same estimates and makes the same choice. Each schedule is laid out on
a :class:`~commfuse_compile.simulator.Timeline` the way the rewrite emits it (same steps, same
dependencies, including the pinned order) and timed on a
:class:`~commfuse_compile.profiles.HardwareProfile`::

    vanilla        collective, then the whole matmul (all-gather) / matmul, then collective
    slicing (K)    K sliced collectives, slice s's collective overlapping slice s±1's matmul
    ring (m)       N·m point-to-point steps, each overlapping one chunk matmul
    bidirectional  the ring with half of every chunk travelling each way (two links busy)

A pattern whose schedule has another shape (the all-to-all's pairwise steps) lays out its own
timelines: its room passes them in ``Workload.timelines``, built from the pieces here
(:func:`compute_seconds`, :func:`collective_seconds`, the lanes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .profiles import HardwareProfile
from .schedules import flash_ag_steps, flash_rs_steps, pieces_per_chunk
from .simulator import Timeline

COMPUTE, COLLECTIVE = "compute", "collective"


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One full ``[m, k] @ [k, n]`` matmul of a match; ``split`` is the dim ("m", "k" or "n")
    that the gathered / scattered dim cuts."""

    m: int
    k: int
    n: int
    split: str = "m"

    def piece(self, count: int) -> tuple[int, int, int]:
        dims = {"m": self.m, "k": self.k, "n": self.n}
        dims[self.split] = max(dims[self.split] // count, 1)
        return dims["m"], dims["k"], dims["n"]


@dataclasses.dataclass(frozen=True)
class Workload:
    kind: str  # "all_gather_matmul" | "matmul_reduce_scatter"
    group_size: int
    matmuls: tuple[Matmul, ...]
    chunk_bytes: int  # one rank's chunk: the shard (all-gather) or one output chunk (reduce-scatter)
    dtype: torch.dtype
    before: int = 0  # all-to-all: how many of ``matmuls`` come before it (the rest after)
    # A pattern's own layout of its schedules, if the generic one does not fit:
    # ``timelines(timeline, work, profile, schedule, m)`` adds the events of ``schedule``.
    timelines: Callable[[Timeline, Workload, HardwareProfile, str, int], None] | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Estimate:
    schedule: str  # "vanilla" | "slicing" | "ring" | "bidirectional"
    chunks_per_rank: int  # m, or K for slicing, 1 for vanilla
    seconds: float
    exposed_comm: float  # makespan minus time the compute lane is busy
    timeline: Timeline = dataclasses.field(compare=False, repr=False, default_factory=Timeline)

    @property
    def label(self) -> str:
        return self.schedule if self.schedule == "vanilla" else f"{self.schedule}(m={self.chunks_per_rank})"


def compute_seconds(work: Workload, profile: HardwareProfile, count: int, slowdown: float) -> float:
    """Time of the matmuls on one of ``count`` equal pieces of the chunked dim."""
    return slowdown * sum(profile.matmul_seconds(*mm.piece(count), work.dtype) for mm in work.matmuls)


def estimate(work: Workload, profile: HardwareProfile, schedule: str, m: int = 1) -> Estimate:
    """Model ``schedule`` (with m chunks per rank / K slices) for ``work`` on ``profile``."""
    timeline = Timeline()
    if work.timelines is not None:
        work.timelines(timeline, work, profile, schedule, m)
    else:
        {"vanilla": _vanilla, "slicing": _slicing, "ring": _ring, "bidirectional": _bidirectional}[schedule](timeline, work, profile, m)
    total = timeline.run()
    return Estimate(schedule, m, total, total - timeline.busy(COMPUTE), timeline)


def step_cost(t: Timeline, profile: HardwareProfile, name: str) -> None:
    """The compute lane's share of one point-to-point step (issuing and finishing it), which
    no overlap hides: ``profile.step_overhead`` (nothing where that is 0)."""
    if profile.step_overhead:
        t.add(f"issue{name}", COMPUTE, profile.step_overhead)


def collective_seconds(work: Workload, profile: HardwareProfile, nbytes: float) -> float:
    """The plain all-gather / reduce-scatter: N-1 steps of one chunk each."""
    return (work.group_size - 1) * profile.collective_step_seconds(nbytes)


def _vanilla(t: Timeline, work: Workload, profile: HardwareProfile, m: int) -> None:
    comm = collective_seconds(work, profile, work.chunk_bytes)
    compute = compute_seconds(work, profile, 1, 1.0)
    if work.kind == "all_gather_matmul":
        t.add("matmul", COMPUTE, compute, (t.add("all_gather", COLLECTIVE, comm),))
    else:
        t.add("reduce_scatter", COLLECTIVE, comm, (t.add("matmul", COMPUTE, compute),))


def _slicing(t: Timeline, work: Workload, profile: HardwareProfile, k: int) -> None:
    slow = profile.overlap_slowdown
    comm = collective_seconds(work, profile, work.chunk_bytes / k)
    compute = compute_seconds(work, profile, k, slow)

    def messages(s: int) -> None:  # a sliced collective beside compute: N - 1 messages' host share
        for step in range(work.group_size - 1):
            step_cost(t, profile, f"[{s}.{step}]")

    if work.kind == "all_gather_matmul":
        gathers = [t.add(f"all_gather[{s}]", COLLECTIVE, comm) for s in range(k)]  # all issued up front
        for s in range(k):
            messages(s)
            t.add(f"matmul[{s}]", COMPUTE, compute, (gathers[s],))
    else:
        for s in range(k):
            t.add(f"reduce_scatter[{s}]", COLLECTIVE, comm, (t.add(f"matmul[{s}]", COMPUTE, compute),))
            messages(s)


def _ring(t: Timeline, work: Workload, profile: HardwareProfile, m: int) -> None:
    _ring_steps(t, work, profile, "ring", m)


def _bidirectional(t: Timeline, work: Workload, profile: HardwareProfile, m: int) -> None:
    _ring_steps(t, work, profile, "bidirectional", m)


def _ring_steps(t: Timeline, work: Workload, profile: HardwareProfile, schedule: str, m: int) -> None:
    """Flash-AG / Flash-RS exactly as the rewrite emits them (:mod:`.schedules`; the steps of
    rank 0 — every rank's have the same shape): each stream of a rank's chunk travels its own
    way round the ring, one hop per step."""
    n, slow = work.group_size, profile.overlap_slowdown
    per_chunk = pieces_per_chunk(schedule, m)
    compute = compute_seconds(work, profile, n * per_chunk, slow)
    transfer = profile.transfer_seconds(work.chunk_bytes / per_chunk)  # (link-bound: not slowed)
    gather = work.kind == "all_gather_matmul"

    def link(direction: int) -> str:  # with 2 ranks both directions reach the same peer
        return "link+" if direction > 0 or n == 2 or not profile.duplex else "link-"

    arrived: dict[int, int | None] = {}  # stream -> transfer event that brought its piece / partial
    computed: dict[int, int] = {}
    steps = (flash_ag_steps if gather else flash_rs_steps)(n, 0, schedule, m)
    for k, step in enumerate(steps):
        for move in (move for sub in step for move in sub):
            name, p = f"[{k}.{move.stream}]", move.stream
            if gather:
                # start reads the piece received last step, whose wait is pinned after that step's matmul
                send = t.add("send" + name, link(move.direction), transfer, (arrived.get(p), computed.get(p))) if move.sends else None
                if move.sends:
                    step_cost(t, profile, name)
                computed[p] = t.add("matmul" + name, COMPUTE, compute, (arrived.get(p),))
                arrived[p] = send
            else:
                # partial sum = matmul + received accumulator, then sent on
                computed[p] = t.add("matmul" + name, COMPUTE, compute)
                if move.sends:
                    arrived[p] = t.add("send" + name, link(move.direction), transfer, (computed[p], arrived.get(p)))
                    step_cost(t, profile, name)


DEFAULT_CHUNKS = {"ring": 1, "bidirectional": 1, "slicing": 4}
AUTO_CHUNKS = {"ring": (1, 2, 4), "bidirectional": (1, 2), "slicing": (2, 4, 8)}


def candidates(schedule: str, chunks_per_rank: int | None, bidirectional: bool = True) -> list[tuple[str, int]]:
    """The (schedule, m) pairs to consider: one for a fixed schedule (``chunks_per_rank`` or its
    default), a few of each for ``auto`` (only ``chunks_per_rank`` if given; the bidirectional
    ring only with ``bidirectional``, see :func:`bidirectional_pays`)."""
    if schedule != "auto":
        return [(schedule, chunks_per_rank or DEFAULT_CHUNKS[schedule])]
    names = [name for name in AUTO_CHUNKS if bidirectional or name != "bidirectional"]
    return [(name, m) for name in names for m in ([chunks_per_rank] if chunks_per_rank else AUTO_CHUNKS[name])]


def bidirectional_pays(profile: HardwareProfile, group_size: int) -> bool:
    """Whether ``auto`` considers the bidirectional ring. Not over more than 2 ranks on links
    that do not carry both directions at once (``duplex`` False): its halves then go to the two
    neighbours over one shared link, which the model prices as the ring with twice the pieces
    but which ran slower than either ring (a sequence-parallel MLP over 4 gloo ranks on a
    shaped 1 Gbit/s loopback: 0.564× Inductor against the ring's 0.515× at m = 1 and 0.532× at
    m = 2). With 2 ranks both halves go to the one peer, as two messages at once, and that ran
    faster than the ring on the same link (0.675× against 0.702× and 0.724×)."""
    return profile.duplex or group_size == 2


def choose(estimates: list[Estimate], vanilla: Estimate, min_speedup: float) -> Estimate | None:
    """The fastest estimate if the model says it beats ``vanilla`` (and by ``min_speedup``);
    None means: leave the match alone."""
    if not estimates:
        return None
    best = min(estimates, key=lambda e: (e.seconds, e.label))
    faster = best.seconds < vanilla.seconds and vanilla.seconds >= min_speedup * best.seconds
    return best if faster else None
