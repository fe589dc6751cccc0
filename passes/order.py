"""Stage 4 — order: pin every ring step as start → compute → wait.

Data dependencies alone allow a scheduler to run a step's wait right after its start (Inductor's
``reorder_for_peak_memory`` does exactly that, to free buffers early), which serialises
communication and compute again. We add two control dependencies per step:

    compute  after  start      (the transfer is in flight while the matmul runs)
    wait     after  compute    (the wait does not block the matmul)

each on the ends of the step's compute only (the nodes no other compute node of the step feeds,
and those that feed none): data orders the rest, and every pinned node becomes a
``control_deps`` call that Inductor lowers and re-propagates on its own.

and two more across steps and sites: every wait comes after the wait before it in the graph
(ring exchanges and collectives alike), and so does every start (a ring exchange or a
collective) after the start before it. Each rank's graph differs in which piece a step
computes, so the scheduler may interleave two independent chains (the m sub-rings of
``chunks_per_rank=2``, or two sites) differently on different ranks, and one rank would wait
on a transfer its peer starts only after a wait of its own: a deadlock (seen at 4 ranks with
m = 2). With every rank waiting in one order, a rank blocked on transfer t has started every
transfer up to t itself (each one's wait comes after its start), so the earliest transfer any
rank is blocked on has been started by both ends. The starts are chained because NCCL ignores
the ``tag`` that keeps two messages between one pair of ranks apart under gloo: it pairs them
in the order they are issued, and collectives of a group too, so every rank must issue them in
the graph's order, which is the same on every rank (``tests/test_p2p_order.py``).

The plan checks (:mod:`.check`) come before every collective and the first wait: a rank blocked
on a transfer before comparing plans, while its peer compares first, would wait on each other,
and a collective started before the comparison (itself a collective) would be matched with it.
Ring starts may come first: a point-to-point send does not block, nor match a collective.

A matmul the graph runs just before a ring's first transfer, needed by neither that transfer
nor the ring (a weight gradient, in backward graphs), would run with nothing in flight: Inductor
orders what we do not pin, and the pieces' kernels changed its choice (a few % of a step on
shaped gloo). Such matmuls are pinned after the ring's first start and before its last wait, so
they overlap its transfers (:func:`_fill_first_windows`).

All of it goes through Inductor's ``preserve_node_ordering`` (a ``control_deps``
higher-order op that the scheduler honours).
"""

from __future__ import annotations

import bisect

import torch
import torch.fx as fx
from torch.utils._ordered_set import OrderedSet

from commfuse_compile._compat import preserve_node_ordering
from commfuse_compile.p2p import WAIT_EXCHANGE

from .graph_utils import MATMULS, WAIT, ring_exchange_op
from .site import Site


def pin_ring_order(graph: fx.Graph, sites: list[Site], checks: list[fx.Node]) -> None:
    """Pin the rings' steps, and the plan ``checks`` before every collective and the first wait."""
    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    waits = [node for node in graph.nodes if node.target is WAIT or node.target is WAIT_EXCHANGE]
    if checks:
        for node in [n for n in graph.nodes if _is_collective(n)] + waits[:1]:
            deps.setdefault(node, OrderedSet()).update(checks)
    _ring_deps(sites, waits, deps)
    if any(site.steps for site in sites):
        starts = [n for n in graph.nodes if n.target is ring_exchange_op() or _is_collective(n)]
        for before, after in zip(starts, starts[1:]):
            deps.setdefault(after, OrderedSet()).add(before)
        _fill_first_windows(graph, sites, waits, deps)
    preserve_node_ordering(graph, deps)
    _follow_replacements(graph, sites)


def _follow_replacements(graph: fx.Graph, sites: list[Site]) -> None:
    """Point the sites' steps at the pinned nodes (``preserve_node_ordering`` replaces every
    node it pins by a ``control_deps`` call of the same name)."""
    by_name = {node.name: node for node in graph.nodes}
    for step in (step for site in sites for step in site.steps):
        step.start = by_name.get(step.start.name) if step.start is not None else None
        step.wait = by_name.get(step.wait.name) if step.wait is not None else None
        step.compute = [by_name.get(node.name, node) for node in step.compute]


def _is_collective(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "_c10d_functional" and target is not WAIT


def _ring_deps(sites: list[Site], waits: list[fx.Node], deps: dict[fx.Node, OrderedSet[fx.Node]]) -> None:
    for site in sites:
        for step in site.steps:
            if step.start is None:
                continue
            # Only the ends of the step's compute need pins: a node fed by another compute node
            # runs after the start through it, and one feeding another runs before the wait.
            computed = set(step.compute)
            for compute in step.compute:
                if not any(node in computed for node in compute.all_input_nodes):
                    deps.setdefault(compute, OrderedSet()).add(step.start)
                if not any(user in computed for user in compute.users):
                    deps.setdefault(step.wait, OrderedSet()).add(compute)
    if any(site.steps for site in sites):
        for before, after in zip(waits, waits[1:]):
            deps.setdefault(after, OrderedSet()).add(before)


def _fill_first_windows(graph: fx.Graph, sites: list[Site], waits: list[fx.Node], deps: dict[fx.Node, OrderedSet[fx.Node]]) -> None:
    """Pin every matmul between a ring's first start and the wait before it (in graph order)
    that neither the start nor any ring needs: after that start, before the ring's last wait.

    The pinned order stays acyclic: a matmul the start needs (through data or pins, those added
    here for an earlier site included) stays where it is, and no pin added here points back
    across a wait (the matmul and the start lie between the same two waits; the ring's last
    wait comes after both)."""
    ring_nodes = {node for site in sites for step in site.steps for node in [step.start, step.wait, *step.compute]}
    nodes = list(graph.nodes)  # (one walk for all sites: the pass stays linear in them)
    position = {node: i for i, node in enumerate(nodes)}
    wait_positions = [position[wait] for wait in waits]  # (in graph order, as ``waits`` is)
    for site in sites:
        pinned = [step for step in site.steps if step.start is not None]
        if not pinned:
            continue
        first, last_wait = pinned[0].start, pinned[-1].wait
        before = bisect.bisect_left(wait_positions, position[first])
        floor = wait_positions[before - 1] if before else -1
        needed = _ancestors(first, deps, lambda node: position[node] > floor)
        for node in nodes[floor + 1 : position[first]]:
            if node.target in MATMULS and node not in needed and node not in ring_nodes:
                deps.setdefault(node, OrderedSet()).add(first)
                deps.setdefault(last_wait, OrderedSet()).add(node)


def _ancestors(node: fx.Node, deps: dict[fx.Node, OrderedSet[fx.Node]], within) -> set[fx.Node]:
    """The nodes ``node`` needs, through its inputs and its pins, as far as ``within`` holds."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        for before in [*current.all_input_nodes, *deps.get(current, ())]:
            if before not in seen and within(before):
                seen.add(before)
                todo.append(before)
    return seen
