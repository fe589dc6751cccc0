"""Stage 2 — plan: decide for each matched Site whether and how to rewrite it.

The decision reads only what every rank of the group shares — the shape and dtype of the
collective's tensor, the group size, the options; never the rank, timing or a dim only this
rank's operand has (see :func:`shared_matmul`) — so every rank of a group makes the same
decision and issues the same ring (a rank-dependent plan would deadlock it). With ``schedule="auto"`` the cost model times vanilla,
slicing, ring and bidirectional (a few m each) on the profile and keeps the fastest, or leaves
the match alone when nothing beats vanilla; its estimates go into the record either way.
"""

from __future__ import annotations

from math import prod

from commfuse_compile.cost_model import Matmul, Workload, candidates, choose, estimate, pieces_per_chunk
from commfuse_compile.options import CommfuseOptions
from commfuse_compile.profiles import resolve_profile

from .graph_utils import ADDMM, fake, left_operand, static_shape
from .site import SYMBOLIC_SIZES, Site

KIND = {"all_gather→mm": "all_gather_matmul", "mm→reduce_scatter": "matmul_reduce_scatter"}
NAMES = {"ring": "ring", "bidirectional": "bidirectional ring", "slicing": "slicing"}


def plan_site(site: Site, options: CommfuseOptions) -> Site:
    if site.decision != "pending":
        return site
    option = "flash_ag" if site.pattern == "all_gather→mm" else "flash_rs"
    if not getattr(options, option):
        return site.skip(f"disabled by option {option}=False")
    if site.group_size == 1:
        return site.skip("group size 1: nothing to exchange")
    tensor = static_shape(site.tensor)
    if tensor is None:
        return site.skip(SYMBOLIC_SIZES)
    problem = _keep_computable_consumers(site, tensor)
    if problem:
        return site.skip(problem)
    return _choose_schedule(site, tensor, options)


def _keep_computable_consumers(site: Site, tensor: list[int]) -> str | None:
    """Drop consumers that cannot be cut into the N chunks at all; why nothing is left, if so."""
    if site.pattern == "mm→reduce_scatter":
        for term in site.consumers:
            problem = (_matmul_problem(term.mm) if term.role != "product" else None) or _cut_problem(site, tensor, term, site.group_size)
            if problem:
                return f"{term.mm.name}: {problem}"
        return None
    kept = []
    for consumer in site.consumers:
        why_not = _matmul_problem(consumer.mm) or _cut_problem(site, tensor, consumer, site.group_size)
        if why_not:
            site.notes.append(f"{consumer.mm.name}: {why_not}; left as is")
        else:
            kept.append(consumer)
    site.consumers = kept
    return None if kept else "no consuming matmul can be computed chunk by chunk: " + "; ".join(site.notes)


def _cut_problem(site: Site, tensor: list[int], consumer, count: int) -> str | None:
    view = consumer.mm if site.pattern == "mm→reduce_scatter" else consumer.view or site.tensor
    return _chunk_problem(tensor, site.dim, count, static_shape(view))


def _choose_schedule(site: Site, tensor: list[int], options: CommfuseOptions) -> Site:
    work = _workload(site)
    profile = resolve_profile(options.profile, fake(site.collective).device.type)
    vanilla = estimate(work, profile, "vanilla")
    feasible, infeasible = [], []
    for schedule, m in candidates("auto" if options.schedule == "off" else options.schedule, options.chunks_per_rank):
        count = site.group_size * pieces_per_chunk(schedule, m)
        problems = [p for c in site.consumers if (p := _cut_problem(site, tensor, c, count))]
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
        best = choose(estimates, vanilla, options.min_speedup_for(KIND[site.pattern]))
        if best is None:
            fastest = min(estimates, key=lambda e: e.seconds)
            return site.skip(
                f"auto ({profile.name}): nothing beats vanilla by min_speedup={options.min_speedup_for(KIND[site.pattern])} "
                f"(vanilla {_ms(vanilla.seconds)}, best {fastest.label} {_ms(fastest.seconds)})"
            )
    else:
        (best,) = estimates
    site.schedule, site.chunks_per_rank = best.schedule, best.chunks_per_rank
    site.modeled = (vanilla, best)
    flash = "Flash-AG" if site.pattern == "all_gather→mm" else "Flash-RS"
    what = f"{flash} {NAMES[best.schedule]}" if best.schedule != "slicing" else f"{flash} slicing baseline, {best.chunks_per_rank} slices"
    pieces = f", {best.chunks_per_rank} pieces per chunk" if best.schedule != "slicing" and best.chunks_per_rank > 1 else ""
    terms = f", {len(site.consumers)} matmuls summed per step" if site.pattern == "mm→reduce_scatter" and len(site.consumers) > 1 else ""
    chosen = f"; auto ({profile.name}): {_ms(best.seconds)} vs vanilla {_ms(vanilla.seconds)}" if options.schedule == "auto" else ""
    site.decision = "rewrite"
    site.reason = f"{what} over {site.group_size} ranks{_on_dim(site)}{pieces}{terms}{chosen}"
    return site


def _workload(site: Site) -> Workload:
    """The site's matmuls and per-rank chunk bytes, for the cost model, from what every rank of
    the group shares (see :func:`shared_matmul`)."""
    moved = site.collective.args[0] if site.pattern == "all_gather→mm" else site.wait
    value = fake(moved)
    matmuls = tuple(shared_matmul(site, c) for c in site.consumers)
    return Workload(KIND[site.pattern], site.group_size, matmuls, value.numel() * value.element_size(), fake(site.consumers[0].mm).dtype)


def shared_matmul(site: Site, consumer) -> Matmul:
    """A consumer matmul ``[m, k] @ [k, n]`` as the cost model sees it, in dims every rank of
    the group has alike.

    The gathered / scattered tensor has one shape on every rank (the collective needs it), so
    the matmul dims it fixes are exact. The matmul's other operand has one dim of its own — a
    column-sharded weight's width, a row-sharded weight's height, an activation's rows — and
    with uneven shards (an FFN of 153 over 2 ranks: 77 and 76) that dim differs between ranks.
    A plan that read it could choose a different schedule on each rank and deadlock the ring,
    so it is modelled as the tensor's width (the other operand as if square there).
    """
    if site.pattern == "mm→reduce_scatter":  # A[rows, k] @ B[k, width], summed into the scattered rows
        rows, width = static_shape(consumer.mm)
        return Matmul(rows, width, width, "m")
    rows, width = static_shape(consumer.view or site.tensor)  # the gathered tensor as the matmul reads it
    if consumer.role == "rows":  # G[rows, width] @ W[width, n]
        return Matmul(rows, width, width, "m")
    if consumer.role == "columns":  # X[m, width] @ G^T[width, rows]
        return Matmul(width, width, rows, "n")
    return Matmul(width, rows, width, "k")  # contraction: G^T[width, rows] @ dY[rows, n], or A[m, rows] @ G


def _matmul_problem(matmul) -> str | None:
    if matmul.target is ADDMM:
        if matmul.kwargs:
            return "addmm with beta/alpha"
        bias, out = static_shape(matmul.args[0]), static_shape(matmul)
        if bias is None or (bias != out and len(bias) != 1):
            return f"addmm bias of shape {bias} is neither 1-D nor the output's shape {out}"
    if static_shape(matmul) is None or static_shape(left_operand(matmul)) is None:
        return "symbolic matmul shape"
    return None


def _chunk_problem(tensor: list[int], dim: int, count: int, rows_by_width: list[int] | None) -> str | None:
    """Why the 2-D matmul operand/result ``rows_by_width`` cannot be cut into the ``count``
    pieces of ``tensor`` along ``dim`` (None if it can).

    dim 0: piece q is elements [q·E, (q+1)·E) of the row-major tensor (E = numel / count), a
    block of whole rows of the 2-D view exactly when E is a multiple of the row width (and of
    the tensor's last dim, the rows a shard is cut into when dim 0 itself is too short).
    dim d > 0: pieces are not contiguous, so each is reshaped on its own; that is exact when the
    2-D view flattens every dim but the last, and d is not that last dim.
    """
    if rows_by_width is None:
        return "symbolic matmul shape"
    rows, width = rows_by_width
    if dim == 0:
        per_piece, rest = divmod(prod(tensor), count)
        if rest or per_piece % width or per_piece % tensor[-1]:
            return f"{tensor} does not split into {count} blocks of whole rows of [{rows}, {width}]"
        return None
    if tensor[dim] % count:
        return f"dim {dim} of {tensor} does not split into {count} pieces"
    if dim == len(tensor) - 1:
        return f"dim {dim} is the last dim (the contraction dim of Flash-AG's matmul, the columns of Flash-RS's): not yet supported"
    if [rows, width] != [prod(tensor[:-1]), tensor[-1]]:
        return f"[{rows}, {width}] is not {tensor} with its leading dims flattened"
    return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _on_dim(site: Site) -> str:
    return f" on dim {site.dim}" if site.dim else ""
