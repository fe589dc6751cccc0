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

A sent tensor that is a view of a value Inductor computes in a kernel of its own (a reshape of
a layout ``clone``, say) is first made a tensor with ``commfuse.contiguous``: Inductor hands
each extern call such a view as a copy of its own, so the start would send one copy and the
wait hold another, and the copy on the wire would be free to reuse. Measured: the Ulysses
output projection's partial products landed in the buffer of the block still being sent.
``contiguous`` is one ATen copy, read by both calls (Inductor made that copy anyway, twice).
"""

from __future__ import annotations

import operator

import torch.fx as fx

from commfuse_compile.p2p import WAIT_EXCHANGE
from commfuse_compile.piece import CONTIGUOUS

from .graph_utils import MATMULS, WAIT, Emitter, aten, ring_exchange_op
from .rowlocal import VIEWS
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
            if _copied_per_reader(start.args[0]):
                start.update_arg(0, Emitter(graph, start)(CONTIGUOUS, start.args[0]))
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


# (getitem is not a view here: it picks an extern op's output, its own tensor)
_VIEWS = (VIEWS - {operator.getitem}) | {aten.transpose.int, aten.t.default}
# Ops whose results Inductor keeps as the extern call's own tensor: a view of one is passed on
# as a view of that buffer, no copy. (Collectives' and commfuse's own ops too: by namespace.)
_OWN_TENSORS = {*MATMULS, operator.getitem}
_OWN_NAMESPACES = ("_c10d_functional", "commfuse")


def _copied_per_reader(sent: fx.Node) -> bool:
    """Whether ``sent`` is a view of a value computed in an Inductor kernel (which Inductor
    may copy once for every extern call reading the view)."""
    if sent.op != "call_function" or sent.target not in _VIEWS:
        return False
    base = sent
    while base.op == "call_function" and base.target in _VIEWS:
        base = base.args[0]
    return base.op == "call_function" and base.target not in _OWN_TENSORS and getattr(base.target, "namespace", None) not in _OWN_NAMESPACES
