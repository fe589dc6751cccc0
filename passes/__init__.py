"""The commfuse graph passes (installed as ``commfuse_compile.passes``).

One stage per module, one data type (:class:`~commfuse_compile.passes.site.Site`) between them:

    match → plan → rewrite → separate → hold → check → order → report

and one module per pattern (:data:`PATTERNS`), which the stages call through the interface of
:class:`~commfuse_compile.passes.pattern.Pattern`: what it matches, the workload the cost model
times, what it emits.

A failure in one site's part of a stage costs that site only (:mod:`.blame`): the graph is put
back and the stages run again with the site left alone, its reason the failure.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch.fx as fx

from commfuse_compile._compat import resolve_process_group
from commfuse_compile.options import CommfuseOptions
from commfuse_compile.report import Report, log

from . import all_reduce
from .all_gather_matmul import AllGatherMatmul
from .all_reduce import AllReduce
from .all_to_all import AllToAll
from .blame import SiteFailure, blame, where
from .check import insert_plan_checks, plan_of
from .fusion import Fuse
from .graph_utils import GraphSnapshot, collapse_wait_chains, erase_dead, recording
from .hold import hold_sent_tensors
from .matmul_reduce_scatter import MatmulReduceScatter
from .moe_ep import MoeExpertParallel
from .order import pin_ring_order
from .pattern import Pattern
from .plan import one_ring_per_matmul, plan_site
from .report import record_sites
from .rewrite import remove_replaced, replaced_by, rewrite_site
from .separate import separate_pieces
from .site import Site

__all__ = ["PATTERNS", "Pattern", "Site", "find_sites", "graph_kind", "group_rank", "run_pipeline"]

# Every pattern, by its one name (Site.pattern, SiteRecord.pattern, min_speedup's keys). An
# all-reduce is split into one of the first two (its halves); the others emit their own steps.
# A collective several patterns know is offered to them in this order, the specific form first.
PATTERNS: dict[str, Pattern] = {p.name: p for p in (AllGatherMatmul(), MatmulReduceScatter(), AllReduce(), MoeExpertParallel(), AllToAll())}
_BY_COLLECTIVE = {target: [p for p in PATTERNS.values() if target in p.collectives] for target in set().union(*(p.collectives for p in PATTERNS.values()))}


def group_rank(group_name: str) -> int:
    """This process's rank within the process group named ``group_name``."""
    return resolve_process_group(group_name).rank()


def graph_kind(graph: fx.Graph, is_inference: bool) -> str:
    """'forward', 'backward' or 'inference' (AOTAutograd names backward inputs ``tangents_*``)."""
    if is_inference:
        return "inference"
    if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return "backward"
    return "forward"


def find_sites(graph: fx.Graph, kind: str) -> list[Site]:
    """Stage 1 — match: a Site for every collective some pattern knows, in graph order
    ("pending" when recognised, "skip" with the reason otherwise). Nothing is mutated."""
    sites: list[Site] = []
    claimed: set[fx.Node] = set()  # collectives a site rewrites besides its own
    for node in graph.nodes:
        if node.target in _BY_COLLECTIVE and node not in claimed:
            site = next(s for p in _BY_COLLECTIVE[node.target] if (s := p.match(node, kind)) is not None)
            claimed |= PATTERNS[site.pattern].claims(site)
            sites.append(site)
    for i, site in enumerate(sites):
        site.key = (i,)
    return sites


def _split_all_reduces(graph: fx.Graph, sites: list[Site], options: CommfuseOptions, kind: str, left_alone: dict) -> tuple[list[Site], list]:
    """Split every matched all-reduce into a reduce-scatter and an all-gather and match those
    (:mod:`.all_reduce`): the sites in graph order, and each split with its two halves."""
    splits = []
    for site in sites:
        if site.pattern != AllReduce.name or site.decision != "pending":
            continue
        if not options.flash_ar:
            site.skip("disabled by option flash_ar=False")
        elif site.group_size == 1:
            site.skip("group size 1: nothing to exchange")
        else:
            with blame(site, "splitting the all-reduce of"):
                splits.append(all_reduce.split(graph, site))
    if not splits:
        return sites, []
    scatter, gather = PATTERNS["matmul_reduce_scatter"], PATTERNS["all_gather_matmul"]
    pairs = []
    for s in splits:
        halves = [scatter.match(s.scatter, kind), gather.match(s.gather, kind)]
        for half, which in zip(halves, ("scatter", "gather")):
            half.key = (*s.site.key, which)
        _leave_alone(halves, left_alone)
        pairs.append((s, halves))
    order = {node: i for i, node in enumerate(graph.nodes)}
    split_at = {id(s.site): order[s.scatter] for s in splits}  # (its collective is gone)
    everything = [*sites, *(half for _, halves in pairs for half in halves)]
    return sorted(everything, key=lambda site: split_at.get(id(site), order.get(site.collective, -1))), pairs


def _settle_all_reduces(graph: fx.Graph, sites: list[Site], pairs: list) -> list[Site]:
    """Keep each split with a rewritten half; put the others' all-reduce back."""
    dropped: set[int] = set()
    for undo, halves in pairs:
        if not all_reduce.settle(undo, halves):
            with blame(undo.site, "putting back the all-reduce of"):
                all_reduce.restore(graph, undo)
            dropped |= {id(half) for half in halves}
    return [site for site in sites if id(site) not in dropped]


def _leave_alone(sites: list[Site], left_alone: dict) -> None:
    """Skip the sites an earlier attempt failed on, with the failure as their reason."""
    for site in sites:
        if (failure := left_alone.get(site.key)) is not None:
            site.skip(failure.reason)


def run_pipeline(
    graph: fx.Graph,
    options: CommfuseOptions,
    kind: str,
    report: Report,
    rank_of: Callable[[str], int] = group_rank,
) -> list[Site]:
    """Run every stage on ``graph`` in place and record the outcome in ``report``.

    A failure that belongs to one site (:mod:`.blame`) costs that site: the graph is put back
    as it was and every stage runs again with the site left alone, its reason the failure
    (``strict=True`` raises instead, when the failure is an error rather than a decision). Any
    other failure restores the whole graph and propagates to the caller (the backend decides
    between warning and ``strict``).
    """
    snapshot = GraphSnapshot(graph)
    left_alone: dict[tuple, SiteFailure] = {}
    while True:
        try:
            sites = _run_stages(graph, options, kind, rank_of, left_alone)
            break
        except SiteFailure as failure:
            snapshot.restore(graph)
            if failure.error is not None and options.strict:
                raise
            if failure.site.key in left_alone:  # (left alone, it cannot fail again: a bug of ours)
                raise RuntimeError(f"commfuse: {where(failure.site)} failed again after it was left alone: {failure.reason}") from failure
            left_alone[failure.site.key] = failure
        except Exception:
            snapshot.restore(graph)
            raise
    _report_failures(kind, [f for f in left_alone.values() if f.error is not None], report)
    record_sites(sites, report)
    return sites


def _report_failures(kind: str, failures: list[SiteFailure], report: Report) -> None:
    """One warning for the graph, naming every site the pass failed on and why; each failure
    is also one of the report's errors (its skip reason says the same)."""
    if not failures:
        return
    messages = [f"commfuse: {failure}" for failure in failures]
    report.errors.extend(messages)
    log.warning(
        "commfuse: %d site(s) of the %s graph left to their plain collective after a failure, the other sites kept: %s",
        len(failures),
        kind,
        "; ".join(str(failure) for failure in failures),
    )


def _run_stages(graph: fx.Graph, options: CommfuseOptions, kind: str, rank_of: Callable[[str], int], left_alone: dict) -> list[Site]:
    """One attempt at every stage, leaving ``left_alone``'s sites alone."""
    collapse_wait_chains(graph)
    sites = find_sites(graph, kind)
    _leave_alone(sites, left_alone)
    sites, splits = _split_all_reduces(graph, sites, options, kind, left_alone)
    for site in sites:
        if site.pattern != AllReduce.name:
            with blame(site, "planning"):
                plan_site(site, options, PATTERNS[site.pattern])
    one_ring_per_matmul(sites)
    sites = _settle_all_reduces(graph, sites, splits)
    plans = [plan_of(site) for site in sites]  # (before the rewrite erases the collectives)
    tags = itertools.count(1)  # same sites in the same order on every rank: tags match
    reserved = set().union(*(PATTERNS[site.pattern].reserved(site) for site in sites)) - {None}
    fuse = Fuse(options.fusion, reserved)
    for site in sites:
        if site.decision == "rewrite" and site.pattern != AllReduce.name:  # (its halves are sites)
            with blame(site, "emitting"), recording(graph) as emitted:
                rewrite_site(graph, site, PATTERNS[site.pattern], rank_of(site.group_name), tags, fuse)
            site.region, site.emitted = [n.name for n in emitted], emitted
            fuse.reserved.update(emitted)  # a later site's fusion must not recompute this ring
            erase_dead(graph, replaced_by(site))  # else they read like outside users to a later region
    remove_replaced(graph, sites)
    separate_pieces(graph, sites)
    hold_sent_tensors(graph, sites)
    checks = insert_plan_checks(graph, sites, plans, options, kind)
    if options.pin_order:
        pin_ring_order(graph, sites, checks)  # (sorts the graph by the pins, or names the ring that cannot be ordered)
    graph.lint()
    return sites
