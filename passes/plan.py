"""Stage 2 — plan: decide for each matched Site whether and how to rewrite it.

The decision reads only what every rank of the group shares — the shape and dtype of the
collective's tensor, the group size, the options; never the rank, timing or a dim only this
rank's operand has (each pattern's ``workload``) — so every rank of a group makes the same
decision and issues the same ring (a rank-dependent plan would deadlock it). With
``schedule="auto"`` the cost model times vanilla, slicing, ring and bidirectional (a few m each)
on the profile and keeps the fastest, or leaves the match alone when nothing beats vanilla; its
estimates go into the record either way.
"""

from __future__ import annotations

import torch.fx as fx

from commfuse_compile.cost_model import bidirectional_pays, candidates, choose, estimate
from commfuse_compile.options import CommfuseOptions
from commfuse_compile.profiles import resolve_profile
from commfuse_compile.schedules import pieces_per_chunk

from .graph_utils import fake
from .pattern import Pattern
from .site import Site, symbolic_problem

NAMES = {"ring": "ring", "bidirectional": "bidirectional ring", "slicing": "slicing"}


def plan_site(site: Site, options: CommfuseOptions, pattern: Pattern) -> Site:
    """Set ``site.decision`` ("rewrite" or "skip"), its reason, schedule, m and estimates."""
    if site.decision != "pending":
        return site
    if not getattr(options, pattern.option):
        return site.skip(f"disabled by option {pattern.option}=False")
    if site.group_size == 1:
        return site.skip("group size 1: nothing to exchange")
    symbolic = symbolic_problem(site)
    if symbolic:
        return site.skip(symbolic)
    tensor = list(fake(site.tensor).shape)  # (ints, and at most one symbolic size)
    problem = pattern.keep_computable(site, tensor)
    if problem:
        return site.skip(problem)
    return _choose_schedule(site, tensor, options, pattern)


def _choose_schedule(site: Site, tensor: list[int], options: CommfuseOptions, pattern: Pattern) -> Site:
    work = pattern.workload(site)
    profile = resolve_profile(options.profile, fake(site.collective).device.type)
    vanilla = estimate(work, profile, "vanilla")
    feasible, infeasible = [], []
    two_ways = bidirectional_pays(profile, site.group_size)
    considered = candidates("auto" if options.schedule == "off" else options.schedule, options.chunks_per_rank, two_ways)
    if options.schedule in ("auto", "off") and not two_ways:
        site.notes.append(f"bidirectional not considered: profile {profile.name} has duplex=False, so over {site.group_size} ranks both neighbours share one link")
    if options.schedule in ("auto", "off"):  # (what the pattern has no rewrite for at all goes unsaid)
        considered = [(s, m) for s, m in considered if pattern.schedule_problem(s, m) is None] or considered
    for schedule, m in considered:
        count = site.group_size * pieces_per_chunk(schedule, m)
        problems = [p for c in site.consumers if (p := pattern.cut_problem(site, tensor, c, count))]
        problems = [p for p in [pattern.schedule_problem(schedule, m)] if p] + problems
        (infeasible if problems else feasible).append((schedule, m, problems[0] if problems else ""))
    if infeasible and feasible:  # say what could not be considered, and why (the first reason)
        labels = ", ".join(f"{schedule}(m={m})" for schedule, m, _ in infeasible)
        site.notes.append(f"not considered: {labels} ({infeasible[0][2]})")
    estimates = [estimate(work, profile, schedule, m) for schedule, m, _ in feasible]
    site.estimates = {e.label: e.seconds for e in [vanilla, *estimates]}
    site.profile = profile.name
    if estimates:
        site.modeled = (vanilla, min(estimates, key=lambda e: (e.seconds, e.label)))
    if options.schedule == "off":
        return site.skip("schedule='off': matched and estimated, left to Inductor")
    if not feasible:
        schedule, m, problem = infeasible[0]
        return site.skip(f"{NAMES[schedule]} with chunks_per_rank={m}: {problem}; choose a chunks_per_rank that divides it")
    if options.schedule == "auto":
        threshold = options.min_speedup_for(pattern.name)
        best = choose(estimates, vanilla, threshold)
        if best is None:
            fastest = min(estimates, key=lambda e: e.seconds)
            return site.skip(
                f"auto ({profile.name}): nothing beats vanilla by min_speedup={threshold} "
                f"(vanilla {_ms(vanilla.seconds)}, best {fastest.label} {_ms(fastest.seconds)})"
            )
    else:
        (best,) = estimates
    site.schedule, site.chunks_per_rank = best.schedule, best.chunks_per_rank
    site.modeled = (vanilla, best)
    flash = pattern.flash
    what = f"{flash} {NAMES[best.schedule]}" if best.schedule != "slicing" else f"{flash} slicing baseline, {best.chunks_per_rank} slices"
    pieces = f", {best.chunks_per_rank} pieces per chunk" if best.schedule != "slicing" and best.chunks_per_rank > 1 else ""
    chosen = f"; auto ({profile.name}): {_ms(best.seconds)} vs vanilla {_ms(vanilla.seconds)}" if options.schedule == "auto" else ""
    site.decision = "rewrite"
    site.reason = f"{what} over {site.group_size} ranks{_on_dim(site)}{pieces}{pattern.describe(site)}{chosen}"
    return site


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _on_dim(site: Site) -> str:
    return f" on dim {site.dim}" if site.dim else ""


def one_ring_per_matmul(sites: list[Site]) -> None:
    """A matmul, and the row-local ops before it, is computed in one Flash-AG ring: the first
    rewrite in graph order takes it, a later one that needs it too is skipped (two gathered
    tensors added before a matmul, as two gradients are in backward)."""
    taken: dict[fx.Node, str] = {}
    for site in sites:
        if site.decision != "rewrite" or site.pattern != "all_gather_matmul":
            continue
        nodes = [c.mm for c in site.consumers] + list(site.prologue)
        if clash := next((n for n in nodes if n in taken), None):
            site.skip(f"{clash.name} is computed in the ring of {taken[clash]} already: one ring per matmul")
            continue
        taken.update({n: site.collective.name for n in nodes})
