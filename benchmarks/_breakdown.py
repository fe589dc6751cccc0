"""Where one step's time goes on a rank: the profiler's ops, sorted into parts and phases.

A step runs under ``torch.profiler`` (CPU; :func:`profile_median_step` profiles three and keeps
the median, as one step's parts swing with what the shared cores did during it). Every op's *self* time (its children's left out)
on the stepping thread goes to one part, so the parts add up to the step:

- ``waiting for transfers``: blocked in a wait (a functional collective's ``wait_tensor``,
  which ``commfuse::wait_exchange`` calls, a c10d work's wait) — communication nothing hid;
- ``starting transfers``: issuing collectives and ring exchanges (the transport's own cost);
- ``matmul``; ``attention`` (scaled dot-product attention, forward and backward);
- ``compiled kernels``: inside a compiled graph's call, in no recorded op — Inductor's C++
  kernels (not recorded on CPU) and its generated wrapper;
- ``eager collectives``: the collectives run eagerly between the compiled graphs — torchtitan
  compiles each block and the loss, so the embedding's reduce-scatter and the output
  projection's all-gather (and their backwards) run as ``spmd_types``' autograd functions,
  which call c10d synchronously: their time is the transfer itself, blocked, and their Python;
- ``DTensor and FSDP``: DTensor's dispatch and FSDP2's hooks, in Python;
- ``other ops``: every other recorded op (the optimizer's, copies, reductions);
- ``Python``: the step's time in no recorded op (autograd, the trainer).

Phases are the trainer's labelled ranges (``tests/titan_trainer.py``'s ``phase``: forward,
loss, backward, grad clipping, optimizer), each with its wall time and its time blocked on
transfers (the first two parts).

Set beside compute alone's (the step on a fake process group), the parts say how much of a
step's gap to the ideal is waiting and how much is compute that ran slower, or more of it.
Profiling adds a few microseconds an op: the parts are shares of the profiled step, not
timings of the steps the benchmark reports.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

PARTS = ("waiting for transfers", "eager collectives", "starting transfers", "matmul", "attention", "compiled kernels", "DTensor and FSDP", "other ops", "Python")
BLOCKED = ("waiting for transfers", "eager collectives")  # (a phase's "waiting_ms")
PHASE_PREFIX = "step: "  # (titan_trainer.PHASE)
STEP_LABEL = "benchmark step"

WAITS = ("wait_tensor", "c10d::wait", "Work.wait", "barrier")
TRANSFERS = ("commfuse::ring_exchange", "c10d::", "c10d_functional::")  # (the last also matches _c10d_functional::)
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")
COMPILED = ("## Call CompiledFxGraph", "CompiledFunction", "TorchDynamo", "Torch-Compiled Region")
# (spmd_types._collectives' autograd functions, forward and backward: _AllGatherShard, ...)
EAGER_COLLECTIVES = ("_AllGather", "_ReduceScatter", "_AllReduce", "_AllToAll")
DTENSOR_FSDP = ("FSDP::", "Redistribute", "ToTorchTensor", "FromTorchTensor", "PythonSubclass")


def part_of(op_name: str) -> str:
    """The part an op's self time belongs to, by its profiler name."""
    for part, keys in (
        ("waiting for transfers", WAITS),
        ("eager collectives", EAGER_COLLECTIVES),
        ("starting transfers", TRANSFERS),
        ("attention", ATTENTION),
        ("compiled kernels", COMPILED),
        ("DTensor and FSDP", DTENSOR_FSDP),
    ):
        if any(key in op_name for key in keys):
            return part
    return "matmul" if op_name in MATMULS else "other ops"


def profile_median_step(step: Callable[[], Any], count: int = 3, before: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Profile ``count`` steps (``before`` runs ahead of each: a barrier on ranks) and return
    the one whose wall time is the median, with every profiled step's wall time
    (``profiled_steps_ms``): one step's parts swing with what the shared cores did during it."""
    profiles = []
    for _ in range(count):
        if before is not None:
            before()
        profiles.append(profile_step(step))
    chosen = sorted(profiles, key=lambda p: p["step_ms"])[len(profiles) // 2]
    return {**chosen, "profiled_steps_ms": [p["step_ms"] for p in profiles]}


def profile_step(step: Callable[[], Any], top: int = 12) -> dict[str, Any]:
    """Run ``step`` once under the profiler. Returns its wall time (``step_ms``), its parts and
    phases (ms; each phase ``{"ms", "waiting_ms"}``) and the ``top`` ops by self time as
    ``[name, part, ms]``, for a reader checking the sorting."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(STEP_LABEL):
            step()
    events = prof.events()
    step_event = next(e for e in events if e.name == STEP_LABEL)
    step_ms = step_event.cpu_time_total / 1e3
    parts = dict.fromkeys(PARTS, 0.0)
    phases: defaultdict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "waiting_ms": 0.0})
    by_op: dict[str, float] = {}
    for event in events:
        if event is step_event or event.thread != step_event.thread or not _within(event, step_event):
            continue  # (the transport's threads: their time shows in the wait that ends it)
        if event.name.startswith(PHASE_PREFIX):
            phases[event.name[len(PHASE_PREFIX):]]["ms"] += event.cpu_time_total / 1e3
            continue
        ms = event.self_cpu_time_total / 1e3
        part = part_of(event.name)
        parts[part] += ms
        by_op[event.name] = by_op.get(event.name, 0.0) + ms
        if part in BLOCKED:
            name = _phase_of(event)
            if name is not None:
                phases[name]["waiting_ms"] += ms
    parts["Python"] = max(0.0, step_ms - sum(parts.values()))
    ranked = sorted(by_op.items(), key=lambda item: -item[1])[:top]
    return {"step_ms": step_ms, "parts_ms": parts, "phases": dict(phases), "top_ops": [[name, part_of(name), ms] for name, ms in ranked]}


def _within(event: Any, outer: Any) -> bool:
    return outer.time_range.start <= event.time_range.start <= outer.time_range.end


def _phase_of(event: Any) -> str | None:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(PHASE_PREFIX):
            return parent.name[len(PHASE_PREFIX):]
        parent = parent.cpu_parent
    return None
