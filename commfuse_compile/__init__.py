"""commfuse: a torch.compile backend that overlaps all-gather / reduce-scatter with matmuls.

    compiled = torch.compile(model, backend="commfuse", options={...})

See :mod:`commfuse_compile.backend` for the backend, :class:`CommfuseOptions` for the options,
:func:`last_report` for what the pass did, and :func:`explain` / :func:`fake_world` to see it for
any world size in one process.
"""

from . import p2p, piece  # noqa: F401  (register torch.ops.commfuse.ring_exchange, .piece, .contiguous)
from .options import CommfuseOptions
from .plan_check import PlanMismatchError
from .explain import explain, fake_world
from .report import CompileReport, Report, SiteRecord, StepRecord, clear_reports, last_report, reports

__version__ = "0.1.0"


def __getattr__(name: str):
    # simple_fsdp pulls in DTensor and checkpointing; the backend does not need them, so they
    # load on first use only.
    if name == "simple_fsdp":
        from .fsdp import simple_fsdp

        return simple_fsdp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CommfuseOptions",
    "CompileReport",
    "PlanMismatchError",
    "Report",
    "SiteRecord",
    "StepRecord",
    "clear_reports",
    "explain",
    "fake_world",
    "last_report",
    "reports",
    "simple_fsdp",
]
