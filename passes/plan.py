"""Stage 2 — plan: decide for each matched Site whether to rewrite it.

The decision reads only shapes, the group size and the options — never the rank or timing —
so every rank of a group makes the same decision and issues the same ring (a rank-dependent
plan would deadlock the ring).
"""

from __future__ import annotations

from math import prod

from commfuse_compile.options import CommfuseOptions

from .graph_utils import static_shape
from .site import Site


def plan_site(site: Site, options: CommfuseOptions) -> Site:
    if site.decision != "pending":
        return site
    enabled = options.flash_ag if site.pattern == "all_gather→mm" else options.flash_rs
    if not enabled:
        option = "flash_ag" if site.pattern == "all_gather→mm" else "flash_rs"
        return site.skip(f"disabled by option {option}=False")
    if site.group_size == 1:
        return site.skip("group size 1: nothing to exchange")
    if site.pattern == "all_gather→mm":
        return _plan_all_gather(site)
    return _plan_reduce_scatter(site)


def _rows_per_chunk(numel: int, group_size: int, row_width: int) -> int | None:
    """Rows of the 2-D matmul operand that belong to one rank, or None if not whole rows.

    A view is row-major, so rank q's chunk of the collective tensor (elements
    [q·E, (q+1)·E) with E = numel / N) is a contiguous block of rows of the 2-D view exactly when
    E is a multiple of the row width.
    """
    per_rank = numel // group_size
    if numel % group_size or per_rank % row_width:
        return None
    return per_rank // row_width


def _plan_all_gather(site: Site) -> Site:
    shard = static_shape(site.collective.args[0])
    if shard is None:
        return site.skip("symbolic shard size: chunks cannot be cut statically")
    kept = []
    for consumer in site.consumers:
        lhs = static_shape(consumer.mm.args[0])
        rhs = static_shape(consumer.mm.args[1])
        if lhs is None or rhs is None:
            site.notes.append(f"{consumer.mm.name}: symbolic matmul shape; left as is")
        elif _rows_per_chunk(prod(shard) * site.group_size, site.group_size, lhs[1]) is None:
            site.notes.append(f"{consumer.mm.name}: a rank's rows are not whole rows of {lhs}; left as is")
        else:
            kept.append(consumer)
    site.consumers = kept
    if not kept:
        return site.skip("no consuming mm can be cut into per-rank row blocks (see notes)")
    site.decision, site.reason = "rewrite", f"Flash-AG ring over {site.group_size} ranks"
    return site


def _plan_reduce_scatter(site: Site) -> Site:
    (consumer,) = site.consumers
    lhs = static_shape(consumer.mm.args[0])
    out = static_shape(consumer.mm)
    if lhs is None or out is None:
        return site.skip("symbolic matmul shape: chunks cannot be cut statically")
    if _rows_per_chunk(prod(out), site.group_size, out[1]) is None:
        return site.skip(f"a rank's chunk is not whole rows of the {out} matmul output")
    site.decision, site.reason = "rewrite", f"Flash-RS ring over {site.group_size} ranks"
    return site
