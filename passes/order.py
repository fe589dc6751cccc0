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

Those chains follow the graph's order, so the graph is first put in an order that its data
and the step pins both allow (:func:`_sort_by_steps`): in the order the rewrites leave, a ring
may sit wholly before another ring whose results its steps read (under selective activation
checkpointing a backward's recomputed activations and its gradients are gathered by two rings
whose matmuls read each other's products), and chaining that order would make a step wait on a
transfer started only after it. Where no order exists, the later ring of the cycle is left to
its plain collective with that reason, and the other rings stay rewritten.

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
import heapq

import torch
import torch.fx as fx
from torch.utils._ordered_set import OrderedSet

from commfuse_compile._compat import preserve_node_ordering, stable_topological_sort
from commfuse_compile.p2p import WAIT_EXCHANGE
from commfuse_compile.piece import PIECE

from .blame import SiteFailure, blame
from .graph_utils import MATMULS, WAIT, ring_exchange_op
from .separate import part_of_cat
from .site import Site


def pin_ring_order(graph: fx.Graph, sites: list[Site], checks: list[fx.Node]) -> None:
    """Pin the rings' steps, and the plan ``checks`` before every collective and the first wait.

    Raises :class:`~.blame.SiteFailure` for a ring whose steps cannot be ordered with another's
    (:func:`_sort_by_steps`); the graph is then put back and that ring left alone."""
    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    _step_deps(sites, deps)
    _sort_by_steps(graph, sites, deps)  # (the chains below follow graph order: make it one the steps allow)
    waits = [node for node in graph.nodes if node.target is WAIT or node.target is WAIT_EXCHANGE]
    if checks:
        for node in [n for n in graph.nodes if _is_collective(n)] + waits[:1]:
            deps.setdefault(node, OrderedSet()).update(checks)
    if any(site.steps for site in sites):
        for before, after in zip(waits, waits[1:]):
            deps.setdefault(after, OrderedSet()).add(before)
        starts = [n for n in graph.nodes if n.target is ring_exchange_op() or _is_collective(n)]
        for before, after in zip(starts, starts[1:]):
            deps.setdefault(after, OrderedSet()).add(before)
        _fill_first_windows(graph, sites, waits, deps)
    preserve_node_ordering(graph, deps)
    _follow_replacements(graph, sites)
    try:
        stable_topological_sort(graph)  # control deps are inputs now: sort by them too
    except AssertionError as err:  # (its assertion has no message)
        raise RuntimeError("commfuse: the pinned order of the rings has a cycle although the steps were sorted first") from err


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


def _step_deps(sites: list[Site], deps: dict[fx.Node, OrderedSet[fx.Node]]) -> None:
    """Each step's compute after its start, its wait after its compute."""
    for site in sites:
        with blame(site, "ordering"):
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


def _sort_by_steps(graph: fx.Graph, sites: list[Site], deps: dict[fx.Node, OrderedSet[fx.Node]]) -> None:
    """Put the graph in an order that its data and the steps' pins (``deps``) both allow,
    staying as close to the present order as they let it (of the nodes ready to go, the
    earliest goes first).

    The waits and starts are then chained in this order. In the order the rewrites left, a
    ring's steps may come wholly before those of a ring they read from (two gathered tensors
    of one backward whose matmuls read each other's products: the recomputed activations and
    the gradients under selective activation checkpointing): chained so, a step of the first
    would wait for a transfer that only starts after a step needing it. Here such steps
    interleave. The order depends only on the graph's structure, which is the same on every
    rank (they differ in which piece a step reads, not in the nodes), so every rank chains
    its transfers alike.

    Where no order exists — a ring's step needs a result of another ring that needs a result
    of this one's later steps — the later ring of that cycle is named in a
    :class:`~.blame.SiteFailure` and left alone."""
    while True:
        order, stuck, before = _steps_order(graph, deps)
        if not stuck:
            break
        cycle = _a_cycle(stuck, before)
        # A step reading a piece of another ring's whole result (a cat of its steps' results)
        # needs every step of it; reading the one step's result its piece is, it needs that step
        # alone. Only done where it breaks a cycle: a cat read whole otherwise stays one buffer
        # that its parts are written into, with no copy made of them.
        parts = [(piece, part) for piece in cycle if piece.target is PIECE and (part := part_of_cat(*piece.args[:4])) is not None]
        if not parts:
            raise _cycle_failure(sites, cycle)
        for piece, part in parts:
            piece.replace_all_uses_with(part)
            graph.erase_node(piece)
    output = next(iter(graph.find_nodes(op="output")))
    for node in order:
        output.prepend(node)


def _steps_order(graph: fx.Graph, deps: dict[fx.Node, OrderedSet[fx.Node]]) -> tuple[list[fx.Node], list[fx.Node], dict]:
    """The nodes in an order their data and ``deps`` allow, the earliest ready node first; the
    nodes that found no place (empty but for a cycle); and every node's predecessors."""
    nodes = [node for node in graph.nodes if node.op != "output"]
    position = {node: i for i, node in enumerate(nodes)}
    before = {node: OrderedSet(n for n in (*node.all_input_nodes, *deps.get(node, ())) if n in position) for node in nodes}
    after: dict[fx.Node, list[fx.Node]] = {node: [] for node in nodes}
    for node, inputs in before.items():
        for earlier in inputs:
            after[earlier].append(node)
    missing = {node: len(inputs) for node, inputs in before.items()}
    ready = [position[node] for node, count in missing.items() if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        order.append(node)
        for later in after[node]:
            missing[later] -= 1
            if missing[later] == 0:
                heapq.heappush(ready, position[later])
    return order, [node for node in nodes if missing[node]], before


def _a_cycle(stuck: list[fx.Node], before: dict[fx.Node, OrderedSet[fx.Node]]) -> list[fx.Node]:
    """A cycle among the nodes a topological sort could not place (each waits for one of them)."""
    stuck_set = set(stuck)
    path, seen = [stuck[0]], {stuck[0]: 0}
    while True:
        node = next(n for n in before[path[-1]] if n in stuck_set)
        if node in seen:
            return path[seen[node] :]
        seen[node] = len(path)
        path.append(node)


def _cycle_failure(sites: list[Site], cycle: list[fx.Node]) -> SiteFailure:
    """The later ring on ``cycle``, and why it is left alone."""
    owner = {node: site for site in sites for node in site.emitted}
    on_cycle = [site for site in sites if any(owner.get(node) is site for node in cycle)]
    if not on_cycle:
        raise RuntimeError(f"commfuse: the graph has a cycle that no ring is part of: {[n.name for n in cycle]}")
    later, others = on_cycle[-1], on_cycle[:-1]
    if others:
        why = f"its steps and those of {others[-1].collective.name}'s ring need each other's results"
    else:
        why = "one of its steps needs a result of a later step"
    reason = f"{why}: no order of the steps lets every step read only what has arrived; left to the plain collective"
    return SiteFailure(later, "ordering", reason=reason)


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
