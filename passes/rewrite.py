"""Stage 3 — rewrite: replace each planned Site by its schedule.

Each pattern's ``emit`` (:mod:`.all_gather_matmul`, :mod:`.matmul_reduce_scatter`) writes its
schedule — ring, bidirectional ring or slicing — in place of the matched nodes: the consumer
matmuls (Flash-AG) or the scattered result (Flash-RS) are replaced by the pieces put back
together (with the ``fusion`` option, the row-local ops next to the ring too: see
:mod:`.fusion`), every step is recorded as a RingStep for the order stage, and the replaced
nodes are left for ``remove_replaced`` once the graph is sorted again.
"""

from __future__ import annotations

import itertools
import operator

import torch.fx as fx

from .fusion import Fuse
from .graph_utils import ALL_GATHER, Emitter, erase_if_unused, fake
from .layout import SYM_SIZE
from .pattern import Pattern
from .site import Site


def rewrite_site(graph: fx.Graph, site: Site, pattern: Pattern, rank: int, tags: itertools.count, fuse: Fuse) -> None:
    """Emit ``site``'s schedule (decision "rewrite") in place, with the row-local ops around it
    that ``fuse`` allows computed inside its steps."""
    site.rank = rank
    pattern.emit(graph, site, rank, tags, fuse)
    _resize_readers(graph, site)


def _resize_readers(graph: fx.Graph, site: Site) -> None:
    """With a symbolic size, the collective's result may be read for its sizes alone
    (``sym_size.int``): read them off its input instead, dim 0 times (all-gather) or divided
    by (reduce-scatter) the group size, so the collective can go."""
    scale = operator.mul if site.collective.target is ALL_GATHER else operator.floordiv
    for reader in [u for u in site.collective.users if u.target is SYM_SIZE]:
        dim = reader.args[1] % fake(site.collective).dim()
        emit = Emitter(graph, before=reader)
        size = emit(SYM_SIZE, site.collective.args[0], dim)
        reader.replace_all_uses_with(emit(scale, size, site.group_size) if dim == 0 else size)
        graph.erase_node(reader)


def replaced_by(site: Site) -> list[fx.Node]:
    """The nodes of the graph that ``site``'s rewrite may have left unread: where a dead-code
    sweep after it starts (it goes on up through their inputs)."""
    consumers = [n for c in site.consumers for n in (c.mm, *c.views, *c.permutes, c.source)]
    return [site.wait, site.tensor, *site.layout, *site.prologue, *site.fused, *consumers]


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
    graph.eliminate_dead_code()  # what only fed the collectives (a movedim before a gather, say)
