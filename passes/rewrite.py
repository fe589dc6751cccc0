"""Stage 3 — rewrite: replace each planned Site by its schedule.

``site.schedule`` says which: ``"ring"`` / ``"bidirectional"`` emit the CommFuse rings
(:mod:`.ring`), ``"slicing"`` the sliced-collective baseline (:mod:`.slicing`). Either way the
consumer matmuls (Flash-AG) or the scattered result (Flash-RS) are replaced by the pieces put
back together (with the ``fusion`` option, the row-local ops next to the ring too: see
:mod:`.fusion`), every step is recorded as a RingStep for the order stage, and the replaced
nodes are left for ``remove_replaced`` once the graph is sorted again.
"""

from __future__ import annotations

import itertools

import torch.fx as fx

from .fusion import Fuse
from .graph_utils import erase_if_unused
from .ring import flash_all_gather, flash_reduce_scatter
from .site import Site
from .slicing import sliced_all_gather, sliced_reduce_scatter


def rewrite_site(graph: fx.Graph, site: Site, rank: int, tags: itertools.count, fuse: Fuse) -> None:
    """Emit ``site``'s schedule (decision "rewrite") in place, with the row-local ops around it
    that ``fuse`` allows computed inside its steps."""
    site.rank = rank
    if site.pattern == "mm→reduce_scatter":
        if site.schedule == "slicing":
            sliced_reduce_scatter(graph, site, fuse)
        else:
            flash_reduce_scatter(graph, site, rank, tags, fuse)
        return
    if site.schedule == "slicing":
        sliced_all_gather(graph, site, fuse)
    else:
        flash_all_gather(graph, site, rank, tags, fuse)


def remove_replaced(graph: fx.Graph, sites: list[Site]) -> None:
    """Drop what the rewrites replaced: dead views, splits and matmuls, then the collectives
    (``wait_tensor`` is side-effectful, so dead-code elimination alone keeps it)."""
    graph.eliminate_dead_code()
    fused = {node for site in sites for node in site.fused}
    # DCE keeps ops it must assume random (attention has a dropout argument): erase the
    # originals of what is now computed piece by piece explicitly.
    erase_if_unused(graph, [node for node in reversed(graph.nodes) if node in fused])
    for site in sites:
        if site.steps:
            erase_if_unused(graph, [site.wait, site.collective])
