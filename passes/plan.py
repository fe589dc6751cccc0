"""Stage 2 — plan: decide for each matched Site whether to rewrite it.

The decision reads only shapes, the group size and the options — never the rank or timing —
so every rank of a group makes the same decision and issues the same ring (a rank-dependent
plan would deadlock the ring).
"""

from __future__ import annotations

from math import prod

from commfuse_compile.options import CommfuseOptions

from .graph_utils import ADDMM, MM, left_operand, static_shape
from .site import SYMBOLIC_SIZES, Site


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
    if site.pattern == "all_gather→mm":
        return _plan_all_gather(site, tensor)
    return _plan_reduce_scatter(site, tensor)


def _plan_all_gather(site: Site, gathered: list[int]) -> Site:
    kept = []
    for consumer in site.consumers:
        why_not = _matmul_problem(consumer.mm) or _chunk_problem(
            gathered, site.dim, site.group_size, static_shape(consumer.view or site.tensor)
        )
        if consumer.role != "rows" and not why_not and consumer.mm.target is not MM:
            why_not = f"{consumer.role} of an addmm: not yet supported"
        if why_not:
            site.notes.append(f"{consumer.mm.name}: {why_not}; left as is")
        else:
            kept.append(consumer)
    site.consumers = kept
    if not kept:
        return site.skip("no consuming matmul can be computed chunk by chunk: " + "; ".join(site.notes))
    site.decision, site.reason = "rewrite", f"Flash-AG ring over {site.group_size} ranks{_on_dim(site)}"
    return site


def _plan_reduce_scatter(site: Site, scattered: list[int]) -> Site:
    for term in site.consumers:
        problem = (_matmul_problem(term.mm) if term.role != "product" else None) or _chunk_problem(
            scattered, site.dim, site.group_size, static_shape(term.mm)
        )
        if problem:
            return site.skip(f"{term.mm.name}: {problem}")
    terms = f", {len(site.consumers)} matmuls summed per step" if len(site.consumers) > 1 else ""
    site.decision, site.reason = "rewrite", f"Flash-RS ring over {site.group_size} ranks{_on_dim(site)}{terms}"
    return site


def _matmul_problem(matmul) -> str | None:
    if matmul.target is ADDMM:
        if matmul.kwargs:
            return "addmm with beta/alpha"
        if static_shape(matmul.args[0]) is None or len(static_shape(matmul.args[0])) != 1:
            return "addmm bias is not a 1-D vector"
    if static_shape(matmul) is None or static_shape(left_operand(matmul)) is None:
        return "symbolic matmul shape"
    return None


def _chunk_problem(tensor: list[int], dim: int, group_size: int, rows_by_width: list[int] | None) -> str | None:
    """Why the 2-D matmul operand/result ``rows_by_width`` cannot be cut into the ``group_size``
    chunks of ``tensor`` along ``dim`` (None if it can).

    dim 0: rank q's chunk is elements [q·E, (q+1)·E) of the row-major tensor (E = numel / N), a
    block of whole rows of the 2-D view exactly when E is a multiple of the row width.
    dim d > 0: chunks are not contiguous, so each is reshaped on its own; that is exact when the
    2-D view flattens every dim but the last, and d is not that last dim.
    """
    if rows_by_width is None:
        return "symbolic matmul shape"
    rows, width = rows_by_width
    if tensor[dim] % group_size:
        return f"dim {dim} of {tensor} does not split into {group_size} chunks"
    if dim == 0:
        per_rank = prod(tensor) // group_size
        return None if per_rank % width == 0 else f"a rank's chunk is not whole rows of [{rows}, {width}]"
    if dim == len(tensor) - 1:
        return f"dim {dim} is the last dim (the contraction dim of Flash-AG's matmul, the columns of Flash-RS's): not yet supported"
    if [rows, width] != [prod(tensor[:-1]), tensor[-1]]:
        return f"[{rows}, {width}] is not {tensor} with its leading dims flattened"
    return None


def _on_dim(site: Site) -> str:
    return f" on dim {site.dim}" if site.dim else ""
