"""Fusion regions: the row-local ops next to a ring that its steps can compute piece by piece.

After Flash-AG (:func:`forward_region`), the ops after the consumer matmuls up to the first op
that mixes rows; before Flash-RS (:func:`backward_region`), the ops producing the scattered
matmuls' left operands. A region never takes another match's nodes, is dropped when it holds
no compute (only views), and before Flash-RS when a value assembled after the ring would feed
the ring itself.
"""

from __future__ import annotations

import dataclasses
import heapq
import operator
from collections.abc import Iterable

import torch.fx as fx

from .attention import attention_refusal, is_attention
from .attention_backward import ATTENTION_BACKWARD, backward_refusal, is_any_attention_backward, is_attention_backward
from .graph_utils import WAIT
from .rowlocal import PARTIAL_SUM, VIEWS, Blocks, axes_of, input_axes
from .site import Site


@dataclasses.dataclass
class Region:
    """Nodes computed piece by piece: ``axis`` maps each to the axis its pieces are cut along
    (``given``: nodes whose pieces the ring supplies); ``count`` pieces in all, equal ones or
    ``blocks`` (sizes known at run time)."""

    axis: dict[fx.Node, int]
    count: int
    given: frozenset[fx.Node] = frozenset()
    blocks: Blocks | None = None

    @property
    def computed(self) -> list[fx.Node]:
        return [n for n in self.axis if n not in self.given]

    def outside_users(self, node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if u not in self.axis]

    def describe(self) -> str:
        return ", ".join(n.name for n in self.computed)

def forward_region(
    site: Site,
    given: dict[fx.Node, int],
    count: int,
    reserved: set[fx.Node],
    stop_at: frozenset = frozenset(),
    trim: bool = True,
    blocks: Blocks | None = None,
    sums: bool = False,
) -> Region | None:
    """The row-local ops after a Flash-AG site's matmuls (``given``: their outputs, with the
    axis their pieces are cut along), or None if there is nothing to compute there. Ops whose
    target is in ``stop_at`` are not entered; ``trim=False`` keeps every node reached;
    ``blocks``: pieces of run-time sizes instead of ``count`` equal ones; ``sums``: a matmul
    contracting over the cut is computed as partial products too (``PARTIAL_SUM``: summed after
    the ring; nothing in the region reads it)."""
    after_ring = _AfterWaits(site.wait)
    axis = dict(given)
    # The users of the region so far, in graph order: a node is looked at once all its inputs
    # have been (the graph is sorted), and only nodes next to the region are visited.
    frontier = [u for n in given for u in n.users]
    heapq.heapify(frontier)
    seen = set(frontier)
    while frontier:
        node = heapq.heappop(frontier)
        if node in axis or node in reserved or node.op != "call_function" or node.target in stop_at:
            continue
        inputs = node.all_input_nodes
        for candidate in (*axes_of(node), *([PARTIAL_SUM] if sums else [])):  # (PARTIAL_SUM: matmuls only)
            cut = input_axes(node, candidate, count, blocks)
            if cut is not None and all(cut[i] == axis[i] if i in axis else not after_ring(i) for i in inputs):
                axis[node] = candidate
                for user in node.users:
                    if user not in seen:
                        seen.add(user)
                        heapq.heappush(frontier, user)
                break
        else:
            if is_any_attention_backward(node):  # (the ring's pieces reach it: say why it is not cut)
                _note(site.notes, f"not fused: {node.name} is computed whole ({_backward_left_whole(node, count, blocks)})")
    if len(axis) == len(given):
        return None
    region = Region(axis, count, frozenset(given), blocks)
    return _trimmed(region, downstream=True) if trim else region

def backward_region(
    roots: dict[fx.Node, int], count: int, reserved: set[fx.Node], read_whole: Iterable[fx.Node], notes: list[str], blocks: Blocks | None = None
) -> Region | None:
    """The row-local ops producing a Flash-RS site's matmul operands (``roots``, with the axis
    their pieces are cut along), or None if there is nothing to compute there or it would form
    a cycle (a value assembled after the ring feeding the ring; said in ``notes``).
    ``read_whole``: the other inputs of the ring's matmuls."""
    axis: dict[fx.Node, int] = {}
    stack = list(roots.items())
    while stack:
        node, along = stack.pop()
        if node in axis:
            if axis[node] != along:
                notes.append(f"not fused: {node.name} would be cut along two dims")
                return None
            continue
        cut = input_axes(node, along, count, blocks) if node.op == "call_function" and node not in reserved else None
        if cut is None and is_attention(node) and node not in reserved:
            _note(notes, f"not fused: {node.name} is computed whole ({attention_refusal(node, along)})")
        if is_attention_backward(node):
            # Not here: its dK and dV would be summed after this ring, which runs after the rings
            # that read them. The ring that brings its output gradient cuts it (forward_region).
            cut = None
        if cut is None:
            continue  # a leaf: sliced
        axis[node] = along
        stack += [(i, a) for i, a in cut.items() if a is not None]
        if is_attention(node):  # its outputs are computed per piece
            stack += [(u, along) for u in node.users]
    region = _trimmed(Region(axis, count, blocks=blocks), downstream=False) if axis else None
    if region is None or any(u.target is not operator.getitem for n in region.axis if is_attention(n) for u in n.users):
        return None
    outside = {i for n in region.axis for i in n.all_input_nodes if i not in region.axis} | set(read_whole)
    if cycle := set(region.axis) & _ancestors(outside):
        notes.append(f"not fused: {min(n.name for n in cycle)} is also needed whole before the ring")
        return None
    return region

def _backward_left_whole(node: fx.Node, count: int, blocks: Blocks | None) -> str:
    """Why a ring's after side does not cut the attention backward its pieces reach."""
    if blocks is not None:
        return "pieces of run-time size"
    if node.target not in ATTENTION_BACKWARD or input_axes(node, 2, count) is None:
        return backward_refusal(node, 2)
    return "the ring's pieces are not its query rows, or an input comes from a later collective"


def _note(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)

def _trimmed(region: Region, downstream: bool) -> Region | None:
    """Keep the compute and the views between it and the ring; drop views that only lead out
    of the region (viewing the assembled value is as good) or only into it from outside
    (slicing the input is as good). None if no compute is left."""
    order = sorted(n for n in region.axis if n not in region.given)
    kept: set[fx.Node] = set()
    for node in reversed(order) if downstream else order:
        near = node.users if downstream else node.all_input_nodes
        if node.target not in VIEWS or any(n in kept for n in near):
            kept.add(node)
    kept |= {n for n in order if n.target is operator.getitem and n.args[0] in kept}  # attention's outputs
    if all(n.target in VIEWS for n in kept):
        return None
    return dataclasses.replace(region, axis={n: a for n, a in region.axis.items() if n in kept or n in region.given})

class _AfterWaits:
    """Whether a node depends on ``wait`` or on any wait after it: a step cannot read those,
    since every wait is pinned after the one before it (``order.py``), so a later collective's
    result is not there yet when this ring's steps run (attention on q's pieces reading k and v
    that another all-to-all brings). Only the nodes after ``wait`` are visited (the graph is
    sorted); answers are kept for the region's walk."""

    def __init__(self, wait: fx.Node):
        self.wait = wait
        self.known: dict[fx.Node, bool] = {}
        self.expanded: set[fx.Node] = set()

    def __call__(self, node: fx.Node) -> bool:
        stack = [node]
        while stack:  # depth first: a node is answered once the inputs after the wait are
            n = stack[-1]
            if n in self.known:
                stack.pop()
                continue
            later = [i for i in n.all_input_nodes if self.wait < i and i not in self.known]
            if later and n not in self.expanded:
                self.expanded.add(n)
                stack += later
                continue
            stack.pop()
            self.known[n] = (self.wait < n and n.target is WAIT) or any(
                i is self.wait or self.known.get(i, False) for i in n.all_input_nodes
            )
        return self.known[node]


def _ancestors(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    return _reachable(nodes, lambda n: n.all_input_nodes)

def _reachable(nodes: Iterable[fx.Node], step) -> set[fx.Node]:
    """Every node reached from ``nodes`` by following ``step`` (users or inputs)."""
    seen, stack = set(), list(nodes)
    while stack:
        for near in step(stack.pop()):
            if near not in seen:
                seen.add(near)
                stack.append(near)
    return seen
