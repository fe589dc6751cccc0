"""What the pass did and why: records per compile, readable from Python and logged.

Every collective the pass looks at becomes a :class:`SiteRecord` — rewritten, or skipped with
the reason. Records are grouped per backend call (one Dynamo graph, its forward and backward)
in a :class:`CompileReport`. Everything is also logged under the ``commfuse_compile`` logger
(``TORCH_LOGS="+commfuse_compile"`` shows it through torch's logging).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading

log = logging.getLogger("commfuse_compile")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One ring step: the chunk it computes and the nodes pinned start → compute → wait."""

    chunk: int
    start: str | None
    compute: tuple[str, ...]
    wait: str | None


@dataclasses.dataclass(frozen=True)
class SiteRecord:
    """One all-gather or reduce-scatter the pass inspected."""

    graph: str  # "forward" | "backward" | "inference"
    pattern: str  # "all_gather→mm" | "mm→reduce_scatter"
    collective: str  # node name in the post-grad graph
    group_name: str
    group_size: int
    shapes: dict[str, list[int]]
    action: str  # "rewritten" | "skipped"
    reason: str
    notes: tuple[str, ...] = ()
    rank: int | None = None
    steps: tuple[StepRecord, ...] = ()
    schedule: str | None = None  # "ring" | "bidirectional" | "slicing" when rewritten
    chunks_per_rank: int | None = None  # m (slices for "slicing") when rewritten
    profile: str | None = None  # the cost model's hardware profile
    estimates: dict[str, float] = dataclasses.field(default_factory=dict)  # modelled seconds per candidate

    @property
    def rewritten(self) -> bool:
        return self.action == "rewritten"

    def summary(self) -> str:
        what = "rewritten" if self.rewritten else "skipped"
        line = (
            f"[{self.graph}] {self.pattern} {self.collective} (group {self.group_name}, "
            f"size {self.group_size}, {_shapes(self.shapes)}): {what} — {self.reason}"
        )
        return "; ".join([line, *self.notes])


@dataclasses.dataclass
class CompileReport:
    """Everything recorded for one call of the ``commfuse`` backend."""

    compile_id: int
    options: dict[str, object]
    sites: list[SiteRecord] = dataclasses.field(default_factory=list)
    graphs: list[str] = dataclasses.field(default_factory=list)  # graph kinds the pass ran on
    cache_hits: int = 0  # graphs Inductor served from its FX cache (the pass did not run)
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def rewritten(self) -> list[SiteRecord]:
        return [s for s in self.sites if s.rewritten]

    @property
    def skipped(self) -> list[SiteRecord]:
        return [s for s in self.sites if not s.rewritten]

    def summary(self) -> str:
        head = (
            f"commfuse compile {self.compile_id}: {len(self.rewritten)} rewritten, "
            f"{len(self.skipped)} skipped in graphs {self.graphs or '[]'}"
        )
        if self.cache_hits:
            head += f"; {self.cache_hits} graph(s) served from Inductor's cache (pass not re-run)"
        return "\n".join([head, *(f"  {s.summary()}" for s in self.sites), *self.errors])


_lock = threading.Lock()
_reports: list[CompileReport] = []
_ids = itertools.count()


def new_report(options: dict[str, object]) -> CompileReport:
    report = CompileReport(compile_id=next(_ids), options=options)
    with _lock:
        _reports.append(report)
    return report


def reports() -> list[CompileReport]:
    """All compile reports of this process, oldest first."""
    with _lock:
        return list(_reports)


def last_report() -> CompileReport | None:
    """The report of the most recent ``commfuse`` compile in this process, if any."""
    with _lock:
        return _reports[-1] if _reports else None


def clear_reports() -> None:
    with _lock:
        _reports.clear()


def _shapes(shapes: dict[str, list[int]]) -> str:
    return ", ".join(f"{k} {list(v)}" for k, v in shapes.items())
