"""Pattern ``moe_ep``: an expert-parallel MoE layer's dispatch → experts → combine, as one
pipeline over the source ranks.

Matches (post-grad aten, a forward graph; torchtitan's all-to-all token dispatcher)::

    y    = wait(all_to_all_single(x, v, u, group))     dispatch; u, v: token counts read with
                                                       .tolist() (splits known at run time)
    yp   = index(y, [perm])                            rank-major -> expert-major rows
    h    = F(yp)                                       pointwise ops and _grouped_mm(·, W, offs),
                                                       offs = cumsum(sum(T, 0), dtype=int32)
    z    = index_put(empty([R, D]), [perm], h)         expert-major -> rank-major
    out  = wait(all_to_all_single(z, u, v, group))     combine: the same splits, swapped

``T`` ([N, e]) counts the tokens of each source rank for each local expert. Block j of ``y``
(the tokens from rank j) is already sorted by local expert, T[j] tokens each, and every row of
F depends only on its own row and its expert: F on block j with offsets ``cumsum(T[j])`` gives
the rows of ``h`` for rank j's tokens, without the permutation and its inverse. So the experts
run on each source rank's tokens as they arrive and the results go straight back (FasterMoE's
pairwise schedule as a ring; :func:`commfuse_compile.schedules.moe_ep_steps`).

The cost model times (:func:`timelines`) the grouped matmuls and one block of tokens at
balanced routing (the token count of ``x`` cut into N equal blocks, as every rank assumes):
vanilla (dispatch, experts, combine) against the pipeline, where only the last combine step
has no compute beside it.

Emits (rank r)::

    blocks = split_with_sizes(x, u)                    block j: my tokens for rank j's experts
    for i, step in moe_ep_steps(N, r):
        start dispatch step (send block r+k to r+k, receive v[r-k] rows from r-k)
        start combine step (send h_(r-k') back to r-k', receive u[r+k'] rows from r+k')
        h_j = F(y_j, offs=cumsum(T[j], int32))          j = r first (never travels), then the
                                                       tokens that arrived at the step before
        wait for both
    out = cat(h_r and the received results, in rank order)

A value of F that the graph reads elsewhere (the activations saved for backward, in the
expert-major layout the backward graph expects; a weight gradient's Xᵀ·dY over every row) is
written block by block to its expert-major rows (``index_put`` at ``inverse(perm)``'s block j,
right after the block is computed, so the copy runs inside the pipeline), and what F reads row
by row from outside (saved activations, in backward) is gathered per block the same way. The
backward's offsets per block are derived from perm and the offsets (T is not saved).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator

import torch
import torch.fx as fx

from commfuse_compile._compat import resolve_process_group
from commfuse_compile.cost_model import COLLECTIVE, COMPUTE, Matmul, Workload, collective_seconds, compute_seconds, step_cost
from commfuse_compile.profiles import HardwareProfile
from commfuse_compile.schedules import moe_ep_steps
from commfuse_compile.simulator import Timeline

from .all_to_all import read_sizes_from_splits, same_own_block
from .fusion import Fuse
from .graph_utils import WAIT, Emitter, aten, c10d, fake, hinted, ring_exchange_op, same_size, shape_of
from .layout import SYM_SIZE, single_wait
from .pattern import Pattern
from .rowlocal import Blocks, is_pointwise
from .site import RingStep, Site

ALL_TO_ALL = c10d.all_to_all_single.default
GROUPED_MM = aten._grouped_mm.default
ZEROS = {aten.new_zeros.default, aten.zeros.default, aten.full.default}
EMPTY = {aten.empty.memory_format, aten.new_empty.default, *ZEROS}


@dataclasses.dataclass
class Sandwich:
    """The nodes of one matched MoE layer (see the module docstring)."""

    dispatch: fx.Node
    dispatch_wait: fx.Node
    permuted: fx.Node  # yp = index(y, [perm])
    perm: fx.Node
    experts: list[fx.Node]  # F, in graph order
    rowwise: list[fx.Node]  # other tensors F reads row by row (saved activations, in backward)
    offsets: fx.Node  # cumsum(sum(T, 0), dtype=int32)
    counts: fx.Node | None  # T: [N, e] tokens per (source rank, local expert); None: not in
    # this graph (a backward, which only saved the offsets): derived from perm and the offsets
    unpermuted: fx.Node  # z = index_put(empty, [perm], h)
    combine: fx.Node
    combine_wait: fx.Node

    @property
    def result(self) -> fx.Node:  # h
        return self.unpermuted.args[2]


class NotADispatch(str):
    """Why an all-to-all is not an MoE dispatch at all (the plain all-to-all pattern's then)."""


def sandwich(node: fx.Node) -> Sandwich | str:
    """The MoE layer whose dispatch is ``node``, or why not: a :class:`NotADispatch` where it
    is no dispatch (run-time splits, its result permuted), else what of the layer differs."""
    x, out_splits, in_splits = node.args[:3]
    if not _run_time(out_splits) or not _run_time(in_splits):
        return NotADispatch("splits known when compiled")
    wait = single_wait(node)
    if wait is None:
        return NotADispatch("not read through a single wait_tensor")
    permuted = [u for u in wait.users if u.target is aten.index.Tensor and u.args[0] is wait and len(u.args[1]) == 1]
    if len(permuted) != 1:
        return NotADispatch("its result is not permuted (index(y, [perm]))")
    (permuted,) = permuted
    perm = permuted.args[1][0]
    experts, rowwise, offsets, problem = _experts(permuted, perm)
    if problem:
        return problem
    unpermuted = next(u for n in experts for u in n.users if _unpermutes(u, perm))
    combines = [u for u in unpermuted.users if u.target is ALL_TO_ALL]
    if len(unpermuted.users) != 1 or len(combines) != 1:
        return f"the experts' output goes back to token order ({unpermuted.name}) but not only to a combine all-to-all"
    (combine,) = combines
    if list(combine.args[1]) != list(in_splits) or list(combine.args[2]) != list(out_splits) or combine.args[3] != node.args[3]:
        return f"the combine ({combine.name}) does not swap the dispatch's splits"
    combine_wait = single_wait(combine)
    if combine_wait is None:
        return f"the combine ({combine.name}) is not read through a single wait_tensor"
    counts = _counts_of(offsets)
    n = resolve_process_group(node.args[3]).size()
    if counts is not None and fake(counts).shape[0] != n:
        return f"the token counts {offsets.name} is read from have {fake(counts).shape[0]} rows, not one per rank ({n})"
    if counts is None and (fake(offsets).dim() != 1 or fake(offsets).dtype is not torch.int32):
        return f"the experts' offsets ({offsets.name}) are not one int32 offset per expert"
    return Sandwich(node, wait, permuted, perm, experts, rowwise, offsets, counts, unpermuted, combine, combine_wait)


def _run_time(splits) -> bool:
    return splits is not None and any(isinstance(v, fx.Node) for v in splits)


def _unpermutes(node: fx.Node, perm: fx.Node) -> bool:
    """``index_put(empty, [perm], h)`` (or accumulated into zeros, as the backward does): the
    rows of h put back where perm took them from. Into an uninitialised tensor this is only
    defined if perm is a permutation, which the pipeline relies on."""
    if node.target is not aten.index_put.default or len(node.args[1]) != 1 or node.args[1][0] is not perm:
        return False
    target, accumulate = node.args[0], node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if target.target not in EMPTY:
        return False
    return not accumulate or (target.target in ZEROS and (target.target is not aten.full.default or target.args[1] == 0))


def _experts(permuted: fx.Node, perm: fx.Node) -> tuple[list[fx.Node], list[fx.Node], fx.Node | None, str | None]:
    """The row-local ops from the permuted tokens to what goes back (pointwise ops and grouped
    matmuls sharing one offsets tensor), the other tensors they read row by row, the offsets,
    or why not."""
    rows = fake(permuted).shape[0]
    region, offsets, frontier = {permuted}, None, list(permuted.users)
    experts: list[fx.Node] = []
    rowwise: dict[fx.Node, None] = {}
    while frontier:
        node = min(frontier)  # (graph order: a node after all its region inputs)
        frontier.remove(node)
        if node in region or _unpermutes(node, perm) or node.op != "call_function":
            continue
        if node.target is GROUPED_MM:
            a, b, offs = (list(node.args) + [None] * 3)[:3]
            if a not in region or b in region or offs is None or node.kwargs or len(node.args) > 3:
                continue  # (a weight gradient, Xᵀ·dY over every row: reads F's values whole)
            if offsets not in (None, offs):
                return [], [], None, f"{node.name}: its grouped matmuls read different offsets"
            offsets, others = offs, []
        elif is_pointwise(node.target) and (others := _row_inputs(node, region, rows)) is not None:
            pass
        else:
            continue  # not part of F: it reads F's values whole (put back together for it)
        region.add(node)
        experts.append(node)
        rowwise.update(dict.fromkeys(others))
        frontier += [u for u in node.users if u not in region]
    if offsets is None:
        return [], [], None, "no grouped matmul (experts) reads the permuted tokens"
    if not any(_unpermutes(u, perm) for n in experts for u in n.users):
        return [], [], None, "the experts' output is not put back to token order (index_put(empty, [perm], ·))"
    return experts, list(rowwise), offsets, None


def _row_inputs(node: fx.Node, region: set[fx.Node], rows) -> list[fx.Node] | None:
    """For a pointwise op over F's rows: its tensor inputs from outside F that it reads row by
    row (in F's expert-major row order, whatever they hold); None if it is not over F's rows
    or an input neither is one nor broadcasts along them."""
    value = fake(node)
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or not same_size(value.shape[0], rows):
        return None
    others = [i for i in node.all_input_nodes if i not in region and isinstance(fake(i), torch.Tensor)]
    if not all(fake(i).dim() < value.dim() or same_size(fake(i).shape[0], 1) or same_size(fake(i).shape[0], rows) for i in others):
        return None
    return [i for i in others if fake(i).dim() == value.dim() and same_size(fake(i).shape[0], rows) and not same_size(rows, 1)]


def _counts_of(offsets: fx.Node) -> fx.Node | None:
    """T of ``cumsum(sum(T, [0]), 0, dtype=int32)``."""
    if offsets.target is not aten.cumsum.default or offsets.kwargs.get("dtype") is not torch.int32:
        return None
    total = offsets.args[0]
    if total.target is not aten.sum.dim_IntList or list(total.args[1]) != [0] or (len(total.args) > 2 and total.args[2]):
        return None
    counts = total.args[0]
    return counts if fake(counts).dim() == 2 else None


class MoeExpertParallel(Pattern):
    name = "moe_ep"
    flash = "expert-parallel pipeline"
    option = "flash_a2a"
    collectives = frozenset({ALL_TO_ALL})

    def match(self, node: fx.Node, graph_kind: str) -> Site | None:
        found = sandwich(node)
        if isinstance(found, NotADispatch):
            return None  # (a plain all-to-all: all_to_all's)
        x, v, u, group_name = node.args[:4]
        site = Site(self.name, graph_kind, node, single_wait(node), group_name, resolve_process_group(group_name).size())
        site.shapes["tokens"] = shape_of(x)
        site.tensor, site.dim = x, 0
        if isinstance(found, str):  # a dispatch whose tokens are permuted, but not to this form
            return site.skip(f"an MoE dispatch not in the expert-parallel pipeline's form: {found}")
        site.blocks = (Blocks(tuple(u), fake(x).shape[0]), Blocks(tuple(v), fake(node).shape[0]))
        return site

    def claims(self, site: Site) -> set[fx.Node]:
        found = sandwich(site.collective)
        return {found.combine} if isinstance(found, Sandwich) else set()

    def keep_computable(self, site: Site, tensor: list[int]) -> str | None:
        return None

    def schedule_problem(self, schedule: str, m: int) -> str | None:
        if schedule != "ring" or m != 1:
            return "the MoE layer is pipelined by source rank, one block per step: schedule='ring' with chunks_per_rank=1 only"
        return None

    def workload(self, site: Site) -> Workload:
        """The grouped matmuls on the tokens, and one block of them, at balanced routing."""
        found = sandwich(site.collective)
        x = fake(site.collective.args[0])
        rows = next((t for t in (x.shape[0], fake(site.collective).shape[0]) if isinstance(t, int)), None) or hinted(x.shape[0])
        matmuls = tuple(
            Matmul(rows, hinted(fake(n.args[0]).shape[-1]), hinted(fake(n.args[1]).shape[-1]), "m") for n in found.experts if n.target is GROUPED_MM
        )
        block = rows * math.prod(hinted(s) for s in x.shape[1:]) * x.element_size() // site.group_size
        return Workload(self.name, site.group_size, matmuls, block, x.dtype, timelines=timelines)

    def describe(self, site: Site) -> str:
        found = sandwich(site.collective)
        return f" (dispatch {site.collective.name}, {len(found.experts)} expert ops per source rank, combine {found.combine.name})"

    def reserved(self, site: Site) -> set[fx.Node]:
        found = sandwich(site.collective)
        if not isinstance(found, Sandwich):
            return {site.collective, site.wait}
        return {found.dispatch, found.dispatch_wait, found.permuted, *found.experts, found.unpermuted, found.combine, found.combine_wait}

    def emit(self, graph: fx.Graph, site: Site, rank: int, tags: itertools.count, fuse: Fuse) -> None:
        found = sandwich(site.collective)
        n, r, x = site.group_size, rank, site.collective.args[0]
        sent, received = site.blocks  # my tokens per destination (u), the tokens per source (v)
        emit = Emitter(graph, before=site.wait)
        same_own_block(emit, site.collective, sent.sizes[r], received.sizes[r])
        blocks = emit(aten.split_with_sizes.default, x, list(sent.sizes), 0)
        tokens: dict[int, fx.Node] = {r: emit(operator.getitem, blocks, r)}  # source rank -> its tokens here
        values: dict[int, dict[fx.Node, fx.Node]] = {}  # source rank -> F's values on its tokens
        results: dict[int, fx.Node] = {}  # destination rank -> my tokens' results from its experts
        layout = _ExpertMajor(emit, found, received)
        block_offsets = _OffsetsPerSource(emit, found, layout)
        saved = _SavedValues(emit, found, layout)
        exchange = ring_exchange_op()
        for step in moe_ep_steps(n, r):
            started = []
            if (d := step.dispatch) is not None:
                outgoing = emit(operator.getitem, blocks, d.send_to)
                started.append((emit(exchange, outgoing, d.send_to, d.recv_from, site.group_name, next(tags), received.sizes[d.recv_from]), "dispatch", d))
            if (c := step.combine) is not None:
                back = values[c.send_to][found.result]
                started.append((emit(exchange, back, c.send_to, c.recv_from, site.group_name, next(tags), sent.sizes[c.recv_from]), "combine", c))
            compute = []
            if step.experts_on is not None:
                j = step.experts_on
                offsets = block_offsets(j)
                rowwise = {z: emit(aten.index.Tensor, z, [layout.positions(j)]) for z in found.rowwise}  # (its rows of them)
                values[j] = _experts_on(emit, found, tokens[j], offsets, rowwise)
                compute = [values[j][node] for node in found.experts]
                saved.put(j, values[j])
            for start, kind, move in started:
                wait = emit(WAIT, start)
                (tokens if kind == "dispatch" else results)[move.recv_from] = wait
                site.steps.append(RingStep(chunk=move.recv_from, compute=compute, start=start, wait=wait))
        results[r] = values[r][found.result]  # (the own tokens' results never travel)
        saved.replace_readers(values)
        _replace_readers(graph, emit, found, tokens, results, n, sent, received)
        site.fused = [found.permuted, *found.experts, found.unpermuted]
        counts = f"cumsum({found.counts.name}[j])" if found.counts is not None else f"derived from {found.perm.name} and {found.offsets.name}"
        site.notes.append(f"per source rank: {', '.join(node.name for node in found.experts)} (offsets {counts})")


class _ExpertMajor:
    """Where each source rank's tokens sit in the expert-major order: block j's rows are at
    ``positions(j)``, the inverse of perm (``index_put(empty, [perm], 0..R-1)``, computed once)
    cut by the blocks."""

    def __init__(self, emit: Emitter, found: Sandwich, received: Blocks):
        self.emit, self.found, self.received = emit, found, received
        self.blocks: fx.Node | None = None

    def rows(self):
        perm = self.found.perm
        return fake(perm).shape[0] if isinstance(fake(perm).shape[0], int) else self.emit(SYM_SIZE, perm, 0)

    def positions(self, j: int) -> fx.Node:
        emit, perm = self.emit, self.found.perm
        if self.blocks is None:
            inverse = emit(aten.index_put.default, emit(aten.empty_like.default, perm), [perm], _iota(emit, self.rows(), fake(perm).device))
            self.blocks = emit(aten.split_with_sizes.default, inverse, list(self.received.sizes), 0)
        return emit(operator.getitem, self.blocks, j)


class _SavedValues:
    """The values of F the graph reads elsewhere (saved for backward, a weight gradient over
    every row), in the expert-major order it reads them in: each block's rows are put at their
    positions as soon as the block is computed, so the copy runs inside the pipeline."""

    def __init__(self, emit: Emitter, found: Sandwich, layout: _ExpertMajor):
        self.emit, self.found, self.layout = emit, found, layout
        self.readers = {node: readers for node in [found.permuted, *found.experts] if (readers := _outside_readers(found, node))}
        self.buffers: dict[fx.Node, fx.Node] = {}
        for node in self.readers:
            value = fake(node)
            if all(isinstance(size, int) for size in value.shape[1:]):
                shape = [layout.rows(), *value.shape[1:]]
                self.buffers[node] = emit(aten.empty.memory_format, shape, dtype=value.dtype, device=value.device)

    def put(self, j: int, values: dict[fx.Node, fx.Node]) -> None:
        for node, buffer in self.buffers.items():
            self.buffers[node] = self.emit(aten.index_put.default, buffer, [self.layout.positions(j)], values[node])

    def replace_readers(self, values: dict[int, dict[fx.Node, fx.Node]]) -> None:
        for node, readers in self.readers.items():
            whole = self.buffers.get(node)
            if whole is None:  # (a symbolic size besides the rows: put together after the last block)
                blocks = [values[j][node] for j in range(len(values))]
                whole = self.emit(aten.index.Tensor, self.emit(aten.cat.default, blocks, 0), [self.found.perm])
            node.replace_all_uses_with(whole, delete_user_cb=lambda user: user in readers)


def _outside_readers(found: Sandwich, node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u not in found.experts and u is not found.unpermuted]


class _OffsetsPerSource:
    """The expert offsets of source rank j's tokens: ``cumsum(T[j])``; where T is not in the
    graph (a backward, which only saved the offsets), the same from perm and the offsets: each
    row's expert is where its expert-major position falls among the offsets (``bucketize``),
    counted per expert within block j."""

    def __init__(self, emit: Emitter, found: Sandwich, layout: _ExpertMajor):
        self.emit, self.found, self.layout = emit, found, layout

    def __call__(self, j: int) -> fx.Node:
        emit, found = self.emit, self.found
        if found.counts is not None:
            counts = emit(aten.select.int, found.counts, 0, j)
        else:
            experts = emit(aten.bucketize.Tensor, self.layout.positions(j), found.offsets, right=True)
            local = _iota(emit, fake(found.offsets).shape[0], fake(found.perm).device)
            counts = emit(aten.sum.dim_IntList, emit(aten.eq.Tensor, emit(aten.unsqueeze.default, experts, 1), local), [0])
        return emit(aten.cumsum.default, counts, 0, dtype=torch.int32)


def _iota(emit: Emitter, length, device: torch.device) -> fx.Node:
    """0 .. length-1 (int64), as post-grad graphs spell ``arange``."""
    return emit(torch.ops.prims.iota.default, length, start=0, step=1, dtype=torch.int64, device=device, requires_grad=False)


def _experts_on(emit: Emitter, found: Sandwich, tokens: fx.Node, offsets: fx.Node, rowwise: dict[fx.Node, fx.Node]) -> dict[fx.Node, fx.Node]:
    """F on the tokens from one source rank, with their own expert ``offsets`` and their rows
    of what F reads row by row."""
    values = {found.permuted: tokens, **rowwise}

    def value(arg):
        return offsets if arg is found.offsets else values.get(arg, arg)

    for node in found.experts:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
        values[node] = emit(node.target, *args, **kwargs)
    return values


def _replace_readers(graph, emit, found, tokens, results, n, sent, received) -> None:
    """The combine's readers read the results in rank order, the dispatch's other readers the
    tokens, size readers the splits."""
    found.combine_wait.replace_all_uses_with(emit(aten.cat.default, [results[j] for j in range(n)], 0))
    others = [u for u in found.dispatch_wait.users if u is not found.permuted]
    if others:  # the tokens in rank order
        rank_major = emit(aten.cat.default, [tokens[j] for j in range(n)], 0)
        found.dispatch_wait.replace_all_uses_with(rank_major, delete_user_cb=lambda user: user in others)
    read_sizes_from_splits(graph, found.dispatch, received)
    read_sizes_from_splits(graph, found.combine, sent)
    graph.erase_node(found.combine_wait)
    graph.erase_node(found.combine)


def timelines(t: Timeline, work: Workload, profile: HardwareProfile, schedule: str, m: int) -> None:
    """Vanilla (dispatch, the experts on every token, combine) or the pipeline of
    :func:`moe_ep_steps` on rank 0 (every rank's has the same shape)."""
    n = work.group_size
    if schedule == "vanilla":
        comm = collective_seconds(work, profile, work.chunk_bytes)
        experts = t.add("experts", COMPUTE, compute_seconds(work, profile, 1, 1.0), (t.add("dispatch", COLLECTIVE, comm),))
        t.add("combine", COLLECTIVE, comm, (experts,))
        return
    if schedule != "ring":
        raise ValueError(f"the MoE pipeline has no {schedule!r} schedule")
    slow = profile.overlap_slowdown
    block, transfer = compute_seconds(work, profile, n, slow), profile.transfer_seconds(work.chunk_bytes)
    back_link = "link-" if profile.duplex and n > 2 else "link+"
    arrived: dict[int, int | None] = {0: None}
    computed: dict[int, int] = {}
    for i, step in enumerate(moe_ep_steps(n, 0)):
        if step.dispatch is not None:
            arrived[step.dispatch.recv_from] = t.add(f"dispatch[{i}]", "link+", transfer)
            step_cost(t, profile, f"[dispatch {i}]")
        if step.combine is not None:
            t.add(f"combine[{i}]", back_link, transfer, (computed[step.combine.send_to],))
            step_cost(t, profile, f"[combine {i}]")
        if step.experts_on is not None:
            computed[step.experts_on] = t.add(f"experts[{i}]", COMPUTE, block, (arrived[step.experts_on],))
