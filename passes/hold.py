"""Stage 3d — hold: every ring transfer's wait reads the tensor it sends.

The transport sends a tensor as it is, without a copy (:mod:`commfuse_compile.p2p`), so the
tensor must stay allocated and unmodified until the transfer's wait. In the graph as emitted,
its last reader is the start, and Inductor, which reuses a buffer once its last reader has
run, could write the step's matmul result into it while it is still on the wire. Waiting with
``commfuse.wait_exchange(received, sent)`` makes the wait a reader of ``sent`` too.

Before::

    received = ring_exchange(sent, to, from, group, tag);  ...compute...;  x = wait_tensor(received)

After::

    received = ring_exchange(sent, to, from, group, tag);  ...compute...;  x = wait_exchange(received, sent)

The ring steps' ``wait`` follow (ordering pins them after their compute next).
"""

from __future__ import annotations

import torch.fx as fx

from commfuse_compile.p2p import WAIT_EXCHANGE

from .graph_utils import WAIT, ring_exchange_op
from .site import Site


def hold_sent_tensors(graph: fx.Graph, sites: list[Site]) -> int:
    """Replace every wait on a ring exchange the sites emitted; returns how many."""
    count = 0
    for site in sites:
        held: dict[fx.Node, fx.Node] = {}
        for i, wait in enumerate(site.emitted):
            if wait._erased or wait.target is not WAIT or wait.args[0].target is not ring_exchange_op():
                continue
            start = wait.args[0]
            with graph.inserting_before(wait):
                hold = graph.call_function(WAIT_EXCHANGE, (start, start.args[0]))
            hold.meta = wait.meta
            wait.replace_all_uses_with(hold)
            graph.erase_node(wait)
            site.emitted[i] = held[wait] = hold
        for step in site.steps:
            step.wait = held.get(step.wait, step.wait)
        renamed = {wait.name: hold.name for wait, hold in held.items()}
        site.region = [renamed.get(name, name) for name in site.region]
        count += len(held)
    return count
