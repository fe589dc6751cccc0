"""``torch.ops.commfuse.check_plan``: the ranks of a group compare their plans once.

Every rank compiles its own graphs. If two ranks of a group plan a graph differently (options
that differ between ranks, say ``schedule="ring"`` on one and ``"bidirectional"`` on another),
their point-to-point sequences do not match and the run dies in the transport or hangs. The
pass therefore puts one ``check_plan(plan, group_name)`` at the start of every graph in which
it matched something, per process group: on the graph's first call the ranks of the group
exchange their plans (one ``all_gather_object``) and, if they differ, every rank raises an
error naming the differing options and matches. Later calls return at once: nothing is
exchanged on the hot path. Under the fake process group (``fake_world``, ``explain``) there is
no one to ask, and the check does nothing.

"First call" is per process: each graph carries a token of its own (kept by Inductor's cache
with its code), and a process compares a token's plan once. A process that resets Dynamo and
compiles the same graphs again, now with options that differ between ranks, is not checked
again unless :func:`reset_checked` is called on every rank (the tests, which reuse their rank
processes, do).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.fx.node import has_side_effect

from ._compat import resolve_process_group

log = logging.getLogger("commfuse_compile")

__all__ = ["PlanMismatchError", "check_plan", "compare_plans", "reset_checked"]

_checked: set[str] = set()  # tokens of the graphs whose plan this process has compared
_lock = threading.Lock()


class PlanMismatchError(RuntimeError):
    """The ranks of a process group planned a graph differently; their rings would not match."""


@torch.library.custom_op("commfuse::check_plan", mutates_args=())
def check_plan(plan: str, group_name: str) -> None:
    """On the first call for ``plan`` (a JSON document with a per-graph ``token``), compare it
    with the plans of the other ranks of ``group_name``; raise :class:`PlanMismatchError` on
    every rank if they differ."""
    mine = json.loads(plan)
    with _lock:
        if mine["token"] in _checked:
            return
        _checked.add(mine["token"])
    group = resolve_process_group(group_name)
    if group.size() == 1 or dist.get_backend(group) == "fake":
        return
    plans: list[Any] = [None] * group.size()
    dist.all_gather_object(plans, mine, group=group)
    members = dist.get_process_group_ranks(group)
    problem, harmless = compare_plans(plans, members)
    if problem:
        raise PlanMismatchError(f"commfuse: the ranks of process group {group_name!r} (global ranks {members}) {problem}")
    if harmless:
        log.warning("commfuse: the ranks of process group %r planned alike, but %s", group_name, harmless)


def reset_checked() -> None:
    """Forget which graphs this process has checked, as if it had just started."""
    with _lock:
        _checked.clear()


@check_plan.register_fake
def _(plan: str, group_name: str) -> None:
    return None


has_side_effect(torch.ops.commfuse.check_plan.default)  # no outputs, but never dead code


def compare_plans(plans: list[dict[str, Any]], members: list[int]) -> tuple[str, str]:
    """(why the plans ``plans[i]`` of global ranks ``members[i]`` cannot run together, or "";
    which options differ although the plans agree, or "")."""
    options = _differing_options(plans, members)
    first = plans[0]
    for rank, plan in zip(members[1:], plans[1:]):
        if plan["sites"] == first["sites"]:
            continue
        where = _first_difference(first["sites"], plan["sites"], members[0], rank)
        cause = (
            f" Their options differ: {options}. Compile with the same options on every rank."
            if options
            else " Their options are the same, so a plan depended on something rank-specific: "
            "a commfuse bug, please report it; options={'schedule': 'off'} avoids it meanwhile."
        )
        return f"planned the {first['graph']} graph differently, so their rings would not match: {where}.{cause}", ""
    return "", f"their options differ: {options}" if options else ""


def _differing_options(plans: list[dict[str, Any]], members: list[int]) -> str:
    keys = sorted({k for plan in plans for k in plan["options"]})
    parts = []
    for key in keys:
        values = [plan["options"].get(key) for plan in plans]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"{v!r} on rank {r}" for r, v in zip(members, values))
            parts.append(f"{key!r} is {per_rank}")
    return "; ".join(parts)


def _first_difference(a: list[dict], b: list[dict], rank_a: int, rank_b: int) -> str:
    if len(a) != len(b):
        return f"{len(a)} matches on rank {rank_a}, {len(b)} on rank {rank_b}"
    i, (x, y) = next((i, pair) for i, pair in enumerate(zip(a, b)) if pair[0] != pair[1])
    return f"match #{i} is {_describe(x)} on rank {rank_a} and {_describe(y)} on rank {rank_b}"


def _describe(site: dict) -> str:
    plan = f"{site['schedule']}(m={site['chunks_per_rank']})" if site["decision"] == "rewrite" else "left alone"
    return f"{site['kind']} of input {site['input']} ({site['dtype']}), {plan}"
