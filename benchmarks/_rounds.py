"""Timing variants side by side on every rank: settling rounds, then timed rounds round-robin.

Untimed settling rounds run one step of every variant, round-robin, until every variant's step
is within a tolerance of its step in the round before (rank 0 decides and tells the others):
without them a variant's first timed rounds ran up to 20% slower than its last. Then each timed
round runs some steps of every variant, the order rotated every round so no variant always
follows the same one. Ranks pass a barrier before every timed step; rank 0 times the step (its
result needs every rank's contribution, so it ends about when the slowest rank's part does).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from _common import median, progress


def settle(steps: dict[str, Callable[[], object]], tolerance: float, max_rounds: int, rank: int) -> list[float]:
    """Untimed rounds of one step of every variant until each variant's step is within
    ``tolerance`` of its step in the round before; rank 0's times decide, for every rank (the
    ranks must run the same number of steps). Returns rank 0's round totals in ms."""
    import torch.distributed as dist

    totals: list[float] = []
    last: dict[str, float] = {}
    for _ in range(max_rounds):
        now: dict[str, float] = {}
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            now[name] = time.perf_counter() - start
        totals.append(sum(now.values()) * 1e3)
        settled = torch.tensor([bool(last) and all(abs(now[k] - last[k]) <= tolerance * last[k] for k in steps)])
        dist.broadcast(settled, src=0)
        if rank == 0:
            progress(f"settling round {len(totals)}: " + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in now.items()) + " ms")
        if settled.item():
            break
        last = now
    return totals


def timed_rounds(steps: dict[str, Callable[[], object]], rounds: int, per_round: int, rank: int) -> tuple[dict[str, list[float]], list[dict[str, float]]]:
    """``rounds`` rounds of ``per_round`` steps of every variant, round-robin, the order rotated
    every round. Returns each variant's step times (ms) and each round's medians."""
    import torch.distributed as dist

    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    round_medians: list[dict[str, float]] = []
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate: no fixed predecessor
        for name in order:
            for _ in range(per_round):
                dist.barrier()
                start = time.perf_counter()
                steps[name]()
                times[name].append((time.perf_counter() - start) * 1e3)
        round_medians.append({name: median(times[name][-per_round:]) for name in names})
        if rank == 0:
            progress(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {median(v):.1f}" for k, v in times.items()) + " ms")
    dist.barrier()
    return times, round_medians
