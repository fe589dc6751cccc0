"""Stage 4 — order: pin every ring step as start → compute → wait.

Data dependencies alone allow a scheduler to run a step's wait right after its start (Inductor's
``reorder_for_peak_memory`` does exactly that, to free buffers early), which serialises
communication and compute again. We add two control dependencies per step:

    compute  after  start      (the transfer is in flight while the matmul runs)
    wait     after  compute    (the wait does not block the matmul)

using Inductor's ``preserve_node_ordering`` (a ``control_deps`` higher-order op that the
scheduler honours).
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils._ordered_set import OrderedSet

from commfuse_compile._compat import preserve_node_ordering

from .site import Site


def pin_ring_order(graph: fx.Graph, sites: list[Site]) -> None:
    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    for site in sites:
        for step in site.steps:
            if step.start is None:
                continue
            for compute in step.compute:
                deps.setdefault(compute, OrderedSet()).add(step.start)
            deps.setdefault(step.wait, OrderedSet()).update(step.compute)
    preserve_node_ordering(graph, deps)
