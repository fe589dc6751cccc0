"""commfuse: a torch.compile backend that overlaps all-gather / reduce-scatter with matmuls.

    compiled = torch.compile(model, backend="commfuse", options={...})

See :mod:`commfuse_compile.backend` for the backend, :class:`CommfuseOptions` for the options
and :func:`last_report` for what the pass did.
"""

from . import p2p  # noqa: F401  (registers torch.ops.commfuse.ring_exchange)
from .options import CommfuseOptions
from .report import CompileReport, SiteRecord, StepRecord, clear_reports, last_report, reports
from .fsdp import simple_fsdp

__version__ = "0.1.0"

__all__ = [
    "CommfuseOptions",
    "CompileReport",
    "SiteRecord",
    "StepRecord",
    "clear_reports",
    "last_report",
    "reports",
    "simple_fsdp",
]
