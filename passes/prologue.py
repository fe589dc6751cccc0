"""Prologue: the row-local ops between a gathered tensor and the matmuls that read it.

Plain tensor parallelism all-reduces after every row-parallel linear; commfuse splits that
all-reduce into a reduce-scatter and an all-gather (:mod:`.all_reduce`), and between the
gathered tensor and the next matmuls come row-local ops — the residual add, RMSNorm::

    G = all_gather(...)                        # [B, S, H], gathered along d
    h = residual + G                           # row-local along d (residual: read in pieces)
    n = h * rsqrt(mean(h * h, -1) + eps) * w   # row-local (w: read whole)
    gate = mm(view(n), Wg); up = mm(view(n), Wu)

Flash-AG computes the prologue on each piece as it arrives, then the matmuls on that piece's
``n``: the prologue is a region (:mod:`.regions`) given G's pieces and stopped at the matmuls.
Its values read elsewhere (``h`` by the next residual add, ``n`` saved for backward) are put
back together once, from the pieces, after the ring.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from .attention import ATTENTION
from .graph_utils import MATMULS, depends_on, fake, same_shape
from .regions import Region, forward_region
from .rowlocal import VIEWS
from .site import Consumer, Site

_STOP = frozenset({*MATMULS, *ATTENTION})


def prologue_region(site: Site, count: int, reserved: set[fx.Node]) -> Region | None:
    """The row-local ops computed from the site's gathered tensor along its dim, ``count``
    pieces, up to (not into) the matmuls and attention that read them."""
    return forward_region(site, {site.tensor: site.dim}, count, reserved, stop_at=_STOP, trim=False)


def prologue_consumers(site: Site, region: Region, matmul_consumers) -> list[Consumer]:
    """The matmuls reading, as their left operand's rows, a prologue value with the gathered
    tensor's leading dims (so its pieces are the gathered tensor's rows), whose other operand
    does not depend on the ring; ``matmul_consumers(node)`` lists a node's matmul readers."""
    leading = list(fake(site.tensor).shape[:-1])
    found: dict[fx.Node, Consumer] = {}
    for node, axis in region.axis.items():
        if node in region.given or node.target in VIEWS or axis != site.dim:
            continue
        if not same_shape(list(fake(node).shape[:-1]), leading):
            continue
        for consumer in matmul_consumers(node):
            if consumer.role == "rows" and consumer.mm not in found and not depends_on(consumer.other_operand(node), site.wait):
                consumer.source = node
                found[consumer.mm] = consumer
    return list(found.values())


def needed(region: Region, consumers: list[Consumer]) -> Region:
    """``region`` cut down to what the consumers read: their sources and the ops before them."""
    keep: set[fx.Node] = set()
    stack = [c.source for c in consumers]
    while stack:
        node = stack.pop()
        if node in keep or node not in region.axis:
            continue
        keep.add(node)
        stack += node.all_input_nodes
    return dataclasses.replace(region, axis={n: a for n, a in region.axis.items() if n in keep})


def prologue_problem(site: Site, count: int, reserved: set[fx.Node]) -> str | None:
    """Why the site's prologue cannot be computed in ``count`` pieces, if so."""
    if fake(site.tensor).shape[site.dim] % count:
        return f"dim {site.dim} of {list(fake(site.tensor).shape)} does not split into {count} pieces for the ops before the matmuls"
    region = prologue_region(site, count, reserved)
    missing = [c.mm.name for c in site.consumers if c.source is not None and (region is None or region.axis.get(c.source) != site.dim)]
    if missing:
        return f"the row-local ops before {', '.join(missing)} do not split into {count} pieces"
    return None

