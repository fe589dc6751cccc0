"""What the pass did and why: records per compile, readable from Python and logged.

Every collective the pass looks at becomes a :class:`SiteRecord` (a *match*) — rewritten, or
skipped with the reason, with the cost model's estimates. Records are grouped per backend call
(one Dynamo graph, its forward and backward) in a :class:`Report`, which also keeps the
rewritten graphs; :func:`commfuse_compile.explain` returns the same type. Everything is logged
under the ``commfuse_compile`` logger (``TORCH_LOGS="+commfuse_compile"`` shows it).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import shutil
import subprocess
import threading
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch.fx as fx

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
    """One all-gather or reduce-scatter the pass inspected (a match)."""

    graph: str  # "forward" | "backward" | "inference"
    pattern: str  # the pattern's name: "all_gather_matmul" | "matmul_reduce_scatter"
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
    fused: tuple[str, ...] = ()  # ops (original node names) computed inside the steps (``fusion``)
    dim: int = 0  # the gathered / scattered dim of the logical tensor
    region: tuple[str, ...] = ()  # nodes the rewrite emitted, in the rewritten graph
    # The modelled timelines (cost_model.Estimate) of vanilla and of the chosen (or best) schedule.
    modeled: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def rewritten(self) -> bool:
        return self.action == "rewritten"

    @property
    def kind(self) -> str:
        """The pattern's name (the same as ``pattern``)."""
        return self.pattern

    @property
    def decision(self) -> str:
        """The schedule used ("ring", "bidirectional", "slicing"), or "skip"."""
        return self.schedule if self.rewritten and self.schedule else "skip"

    def summary(self) -> str:
        what = "rewritten" if self.rewritten else "skipped"
        line = (
            f"[{self.graph}] {self.pattern} {self.collective} (group {self.group_name}, "
            f"size {self.group_size}, {_shapes(self.shapes)}): {what} — {self.reason}"
        )
        return "; ".join([line, *self.notes])


@dataclasses.dataclass
class Report:
    """Everything recorded for one call of the ``commfuse`` backend (or one :func:`explain`)."""

    compile_id: int
    options: dict[str, object]
    sites: list[SiteRecord] = dataclasses.field(default_factory=list)
    graph_kinds: list[str] = dataclasses.field(default_factory=list)  # graphs the pass ran on
    graphs: RewrittenGraphs = dataclasses.field(default_factory=lambda: RewrittenGraphs())  # rewritten, by kind
    cache_hits: int = 0  # graphs Inductor served from its FX cache (the pass did not run)
    errors: list[str] = dataclasses.field(default_factory=list)
    pass_seconds: float = 0.0  # wall time spent in the commfuse pass (all graphs of this compile)

    @property
    def matches(self) -> list[SiteRecord]:
        """Every candidate pattern, rewritten or skipped."""
        return self.sites

    @property
    def rewritten(self) -> list[SiteRecord]:
        return [s for s in self.sites if s.rewritten]

    @property
    def skipped(self) -> list[SiteRecord]:
        return [s for s in self.sites if not s.rewritten]

    def add_graph(self, kind: str, graph: fx.Graph) -> None:
        """Keep a copy of a rewritten graph (a second graph of a kind gets a numbered key)."""
        self.graphs.keep(_free_key(self.graphs, kind), graph)

    def summary(self) -> str:
        """A readable table: one row per match, then each match's reason and notes."""
        head = (
            f"commfuse compile {self.compile_id}: {len(self.rewritten)} rewritten, "
            f"{len(self.skipped)} skipped in graphs {self.graph_kinds or '[]'}"
        )
        if self.cache_hits:
            head += f"; {self.cache_hits} graph(s) served from Inductor's cache (pass not re-run)"
        rows = [("#", "graph", "kind", "group", "dim", "tensor", "decision", "model vs vanilla")]
        for i, s in enumerate(self.sites):
            tensor = _shapes(dict(list(s.shapes.items())[:1]))  # the shard / the scattered input
            rows.append((str(i), s.graph, s.kind, f"{s.group_size}", str(s.dim), tensor, _decision(s), _speedup(s)))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        why = [f"  #{i}: {'; '.join([s.reason, *s.notes])} ({_shapes(s.shapes)})" for i, s in enumerate(self.sites)]
        return "\n".join([head, *table, *why, *self.errors])

    def to_dot(self, path: str, match: int | None = None) -> str:
        """Write the rewritten region of a match (default: the first rewritten one) as a DOT
        graph — ring transfers, their waits, the matmuls and fused ops, and the inputs they read
        — and, when Graphviz's ``dot`` is installed, an SVG next to it. Returns the DOT path."""
        from .dot import region_dot

        index = match if match is not None else next((i for i, s in enumerate(self.sites) if s.rewritten), None)
        if index is None or not self.sites[index].rewritten:
            raise ValueError(f"to_dot: match {index} was not rewritten; rewritten matches: {[i for i, s in enumerate(self.sites) if s.rewritten]}")
        site = self.sites[index]
        graph = self.graphs.get(site.graph)
        if graph is None:
            raise ValueError(f"to_dot: the {site.graph} graph was not kept (served from Inductor's cache?)")
        with open(path, "w") as f:
            f.write(region_dot(graph.graph, site, title=f"#{index} {site.summary().split(':')[0]}"))
        if shutil.which("dot"):
            subprocess.run(["dot", "-Tsvg", path, "-o", path.rsplit(".", 1)[0] + ".svg"], check=True)
        return path

    def to_chrome_trace(self, path: str) -> None:
        """Write the modelled timelines (compute lane, one lane per link direction, one event
        per step) of vanilla and of the chosen schedule of every match, for chrome://tracing or
        https://ui.perfetto.dev."""
        from .trace import write_chrome_trace

        named = [(f"#{i} {s.graph} {s.kind}: {e.label}", e) for i, s in enumerate(self.sites) for e in s.modeled]
        write_chrome_trace(path, [e for _, e in named], title=f"commfuse compile {self.compile_id}", names=[n for n, _ in named])


CompileReport = Report  # the name before inspection existed


def _decision(site: SiteRecord) -> str:
    return site.modeled[1].label if site.rewritten and site.modeled else site.decision


def _speedup(site: SiteRecord) -> str:
    """The modelled time of the chosen (or, if skipped, the best) schedule against vanilla."""
    if not site.modeled:
        return ""
    vanilla, chosen = site.modeled
    return f"{chosen.label} {chosen.seconds * 1e3:.3g} ms vs {vanilla.seconds * 1e3:.3g} ms"


class _Copied:
    """A copy of a rewritten graph and the attributes its ``get_attr`` nodes read."""

    def __init__(self, graph: fx.Graph):
        from commfuse_compile.passes.graph_utils import GraphSnapshot

        self.graph = GraphSnapshot(graph).saved  # (Inductor's later passes edit the original)
        owner = getattr(graph, "owning_module", None)
        self.attrs = {n.target: _attribute(owner, n.target) for n in self.graph.find_nodes(op="get_attr")}


def _attribute(module: Any, target: str) -> Any:
    for name in target.split("."):
        module = getattr(module, name)
    return module


class RewrittenGraphs(MutableMapping[str, fx.GraphModule]):
    """The rewritten graphs of a report by kind (``"forward"``, ``"backward"``, ``"forward#1"``...).

    Each is copied when the pass finishes, and made an ``fx.GraphModule`` (which generates and
    compiles its Python code, a large share of the pass's own time on big graphs) only when it
    is first read: most compiles never read theirs.
    """

    def __init__(self) -> None:
        self._entries: dict[str, fx.GraphModule | _Copied] = {}

    def keep(self, kind: str, graph: fx.Graph) -> None:
        """Copy ``graph`` (as it is now) under ``kind``."""
        self._entries[kind] = _Copied(graph)

    def entries(self) -> list[tuple[str, fx.GraphModule | _Copied]]:
        """The stored entries as they are (for merging reports without building modules)."""
        return list(self._entries.items())

    def put_entry(self, kind: str, entry: fx.GraphModule | _Copied) -> None:
        self._entries[kind] = entry

    def __getitem__(self, kind: str) -> fx.GraphModule:
        entry = self._entries[kind]
        if isinstance(entry, _Copied):
            entry = self._entries[kind] = fx.GraphModule(entry.attrs, entry.graph)
        return entry

    def __setitem__(self, kind: str, module: fx.GraphModule) -> None:
        self._entries[kind] = module

    def __delitem__(self, kind: str) -> None:
        del self._entries[kind]

    def __contains__(self, kind: object) -> bool:
        return kind in self._entries  # (Mapping's own would build the module)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"RewrittenGraphs({list(self._entries)})"


def _free_key(graphs: MutableMapping[str, fx.GraphModule], kind: str) -> str:
    """``kind``, or ``kind#1``, ``kind#2``, ... if taken (several graphs of one kind)."""
    return next(k for k in itertools.chain([kind], (f"{kind}#{i}" for i in itertools.count(1))) if k not in graphs)


_lock = threading.Lock()
_reports: list[Report] = []
_ids = itertools.count()


def new_report(options: dict[str, object]) -> Report:
    report = Report(compile_id=next(_ids), options=options)
    with _lock:
        _reports.append(report)
    return report


def merge_reports(parts: list[Report]) -> Report:
    """One report of several compiles (a function with graph breaks compiles once per graph)."""
    merged = Report(compile_id=parts[0].compile_id if parts else -1, options=parts[0].options if parts else {})
    for part in parts:
        merged.sites += part.sites
        merged.graph_kinds += part.graph_kinds
        merged.errors += part.errors
        merged.cache_hits += part.cache_hits
        merged.pass_seconds += part.pass_seconds
        for kind, entry in part.graphs.entries():
            merged.graphs.put_entry(_free_key(merged.graphs, kind.split("#")[0]), entry)
    return merged


def reports() -> list[Report]:
    """All compile reports of this process, oldest first."""
    with _lock:
        return list(_reports)


def last_report() -> Report | None:
    """The report of the most recent ``commfuse`` compile in this process, if any."""
    with _lock:
        return _reports[-1] if _reports else None


def clear_reports() -> None:
    with _lock:
        _reports.clear()


def _shapes(shapes: dict[str, list[int]]) -> str:
    return ", ".join(f"{k} {list(v)}" for k, v in shapes.items())
