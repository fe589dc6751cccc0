"""Chrome / Perfetto traces of cost-model estimates.

Each :class:`~commfuse_compile.cost_model.Estimate` becomes one process named by its label, each
lane of its timeline one thread, each event one complete ("X") event. Open the JSON in
``chrome://tracing`` or https://ui.perfetto.dev to compare schedules side by side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .cost_model import Estimate

# Fixed thread ids so that a lane sits on the same row in every process.
LANES = ("compute", "link+", "link-", "collective")

_US = 1e6  # trace timestamps are microseconds; the timeline is in seconds


def _tid(lane: str, extra: list[str]) -> int:
    if lane in LANES:
        return LANES.index(lane) + 1
    if lane not in extra:
        extra.append(lane)
    return len(LANES) + extra.index(lane) + 1


def _metadata(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _process_events(pid: int, est: Estimate, name: str) -> list[dict[str, Any]]:
    """The metadata and complete events of one estimate."""
    summary = {"total_ms": est.seconds * 1e3, "exposed_comm_ms": est.exposed_comm * 1e3}
    extra: list[str] = []
    events = [
        _metadata("process_name", pid, 0, name),
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    lanes: dict[str, int] = {}
    for i, ev in enumerate(est.timeline.events):
        tid = lanes.setdefault(ev.lane, _tid(ev.lane, extra))
        events.append({
            "name": ev.name, "cat": ev.lane, "ph": "X", "pid": pid, "tid": tid,
            "ts": ev.start * _US, "dur": ev.duration * _US,
            "args": {"id": i, "deps": list(ev.deps), **summary},
        })
    for lane, tid in sorted(lanes.items(), key=lambda item: item[1]):
        events.append(_metadata("thread_name", pid, tid, lane))
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return events


def chrome_trace(estimates: Sequence[Estimate], title: str = "", names: Sequence[str] | None = None) -> dict[str, Any]:
    """A Chrome trace dict with one process per estimate (pids 1, 2, ... in the given order),
    named by ``names`` (default: each estimate's label).

    The estimates' timelines must have been run (``estimate()`` does that), so that each event
    has its start and end. Every complete event's ``args`` carry the estimate's total and
    exposed communication in milliseconds, plus the event's id and dependency ids.
    """
    events: list[dict[str, Any]] = []
    names = names or [est.label for est in estimates]
    for pid, (est, name) in enumerate(zip(estimates, names), start=1):
        events.extend(_process_events(pid, est, name))
    trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if title:
        trace["otherData"] = {"title": title}
    return trace


def write_chrome_trace(path: str, estimates: Sequence[Estimate], title: str = "", names: Sequence[str] | None = None) -> None:
    """Write :func:`chrome_trace` of ``estimates`` as JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(chrome_trace(estimates, title, names), f, indent=1)
