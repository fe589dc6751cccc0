"""The commfuse graph passes (installed as ``commfuse_compile.passes``).

One stage per module, one data type (:class:`~commfuse_compile.passes.site.Site`) between them:

    match → plan → rewrite → separate → hold → check → order → report

and one module per pattern (:data:`PATTERNS`), which the stages call through the interface of
:class:`~commfuse_compile.passes.pattern.Pattern`: what it matches, the workload the cost model
times, what it emits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch.fx as fx

from commfuse_compile._compat import resolve_process_group, stable_topological_sort
from commfuse_compile.options import CommfuseOptions
from commfuse_compile.report import Report

from . import all_reduce
from .all_gather_matmul import AllGatherMatmul
from .all_reduce import AllReduce
from .all_to_all import AllToAll
from .check import insert_plan_checks, plan_of
from .fusion import Fuse
from .graph_utils import GraphSnapshot, erase_dead, recording
from .hold import hold_sent_tensors
from .matmul_reduce_scatter import MatmulReduceScatter
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
PATTERNS: dict[str, Pattern] = {p.name: p for p in (AllGatherMatmul(), MatmulReduceScatter(), AllReduce(), AllToAll())}
_BY_COLLECTIVE = {target: p for p in PATTERNS.values() for target in p.collectives}


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
    return [_BY_COLLECTIVE[node.target].match(node, kind) for node in graph.nodes if node.target in _BY_COLLECTIVE]


def _split_all_reduces(graph: fx.Graph, sites: list[Site], options: CommfuseOptions, kind: str) -> tuple[list[Site], list]:
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
            splits.append(all_reduce.split(graph, site))
    if not splits:
        return sites, []
    scatter, gather = PATTERNS["matmul_reduce_scatter"], PATTERNS["all_gather_matmul"]
    pairs = [(s, [scatter.match(s.scatter, kind), gather.match(s.gather, kind)]) for s in splits]
    order = {node: i for i, node in enumerate(graph.nodes)}
    split_at = {id(s.site): order[s.scatter] for s in splits}  # (its collective is gone)
    everything = [*sites, *(half for _, halves in pairs for half in halves)]
    return sorted(everything, key=lambda site: split_at.get(id(site), order.get(site.collective, -1))), pairs


def _settle_all_reduces(graph: fx.Graph, sites: list[Site], pairs: list) -> list[Site]:
    """Keep each split with a rewritten half; put the others' all-reduce back."""
    dropped: set[int] = set()
    for undo, halves in pairs:
        if not all_reduce.settle(undo, halves):
            all_reduce.restore(graph, undo)
            dropped |= {id(half) for half in halves}
    return [site for site in sites if id(site) not in dropped]


def run_pipeline(
    graph: fx.Graph,
    options: CommfuseOptions,
    kind: str,
    report: Report,
    rank_of: Callable[[str], int] = group_rank,
) -> list[Site]:
    """Run every stage on ``graph`` in place and record the outcome in ``report``.

    If any stage raises, the graph is restored as it was; the error propagates to the caller
    (the backend decides between warning and ``strict``).
    """
    snapshot = GraphSnapshot(graph)
    try:
        sites, splits = _split_all_reduces(graph, find_sites(graph, kind), options, kind)
        sites = [site if site.pattern == AllReduce.name else plan_site(site, options, PATTERNS[site.pattern]) for site in sites]
        one_ring_per_matmul(sites)
        sites = _settle_all_reduces(graph, sites, splits)
        plans = [plan_of(site) for site in sites]  # (before the rewrite erases the collectives)
        tags = itertools.count(1)  # same sites in the same order on every rank: tags match
        reserved = set().union(*(PATTERNS[site.pattern].reserved(site) for site in sites)) - {None}
        fuse = Fuse(options.fusion, reserved)
        for site in sites:
            if site.decision == "rewrite" and site.pattern != AllReduce.name:  # (its halves are sites)
                with recording(graph) as emitted:
                    rewrite_site(graph, site, PATTERNS[site.pattern], rank_of(site.group_name), tags, fuse)
                site.region, site.emitted = [n.name for n in emitted], emitted
                fuse.reserved.update(emitted)  # a later site's fusion must not recompute this ring
                erase_dead(graph, replaced_by(site))  # else they read like outside users to a later region
        remove_replaced(graph, sites)
        separate_pieces(graph, sites)
        hold_sent_tensors(graph, sites)
        checks = insert_plan_checks(graph, sites, plans, options, kind)
        if options.pin_order:
            pin_ring_order(graph, sites, checks)
            stable_topological_sort(graph)  # control deps are inputs now: sort by them too
        graph.lint()
    except Exception:
        snapshot.restore(graph)
        raise
    record_sites(sites, report)
    return sites
