"""Pattern ``all_to_all``: an all-to-all next to row-local compute, as Flash-All-to-All.

Matches (post-grad aten graph, functional collectives)::

    all_to_all_single(x, splits, splits, group) -> wait_tensor     equal splits: x is N blocks
                                                                   of dim 0
    all_to_all_single(x, [v0..], [u0..], group) -> wait_tensor     splits known at run time
                                                                   (MoE token counts: u_j, v_j
                                                                   from .tolist())

With run-time splits the blocks are cut by ``split_with_sizes(x, [u0..])``, step k receives
``v_(r-k)`` rows, an empty block is neither sent nor received (both peers know its size), the
own block's two sizes (u_r cut, v_r in the result: the same number) are asserted equal so the
result keeps its size, and ``sym_size(all_to_all, 0)`` reads ``sum(v)``. The plan depends on no
size: every rank plans alike, and one compile serves every routing.

Left alone: an all-to-all whose result is read on the host within a few ops (MoE routing's
token-count exchange, read by ``.tolist()`` for the next all-to-all's splits): the host waits
for all of it, and steps would only add latency before that sync.

Block j of ``x`` goes to rank j, and the block received from rank j lands at block j of the
result. Ops row-local in dim 0 next to it are computed block by block (:mod:`.regions`): *after*
it (the expert FFN on the tokens received from rank j in an MoE dispatch, the layout ops and
projections of Ulysses), each block as it arrives; *before* it (the expert output sent back in
an MoE combine, query-split attention before Ulysses' second all-to-all), each outgoing block
just before its step. After it, a matmul reading the result by column blocks (Ulysses'
projections of a head group's columns: a cut along the contracted dim) is computed as partial
products, block j of the result times the weight's rows of block j, summed after the ring.

The cost model times (:func:`AllToAll.workload`): the matmuls of both sides (attention and its
backward as the matmuls of their FLOPs), cut into N blocks,
and one block in bytes (run-time splits: at balanced routing): vanilla (the ops before, the all-to-all, the ops after) against the N − 1
pairwise steps.

Emits (rank r; :func:`commfuse_compile.schedules.all_to_all_steps`)::

    out_r = x_r                                    # never travels: after-compute starts at once
    send = x_{r+1}                                 # before-compute: the first block to send
    for k in 1 .. N-1:
        recv = ring_exchange(send, to=r+k, from=r-k)
        compute x_{r+k+1} (x_r at the last step)   # before: the next block to send, own last
        compute after(out_j) for the block j that arrived last (out_r at the first step)
        out_{r-k} = wait_tensor(recv)
    compute after(out_{r-N+1})                     # the last block (with a before side: also out_r)
    out = cat(out_0, ..., out_{N-1})               # only if something reads it whole

Nothing waits on the network first (the own block) and the before side's last step computes
the own block (no transfer); with both sides, the own block's after-compute waits for its
before-compute, at the end.
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
from commfuse_compile.simulator import Timeline
from commfuse_compile.schedules import all_to_all_steps

from .attention import ATTENTION, arguments
from .attention_backward import ATTENTION_BACKWARD
from .fusion import Fuse, attention_note
from .graph_utils import MATMULS, WAIT, Emitter, aten, c10d, describe_users, fake, hinted, hinted_shape, left_operand, ring_exchange_op, shape_of, target_name
from .layout import SYM_SIZE, single_wait
from .pattern import Pattern
from .pieces import Pieces, cut
from .regions import Region, backward_region, forward_region
from .rowlocal import PARTIAL_SUM, Blocks
from .site import RingStep, Site

ALL_TO_ALL = c10d.all_to_all_single.default


class AllToAll(Pattern):
    name = "all_to_all"
    flash = "Flash-All-to-All"
    option = "flash_a2a"
    collectives = frozenset({ALL_TO_ALL})

    def match(self, node: fx.Node, graph_kind: str) -> Site:
        x, out_splits, in_splits, group_name = node.args[:4]
        n = resolve_process_group(group_name).size()
        site = Site(self.name, graph_kind, node, single_wait(node), group_name, n)
        site.shapes["input"] = shape_of(x)
        site.tensor, site.dim = x, 0
        if (host := read_on_host(node)) is not None:
            return site.skip(
                f"its result is read on the host ({host.name}: .tolist() / .item(), as MoE routing reads its "
                f"token-count exchange): decomposing it would only delay that sync"
            )
        if site.wait is None:
            return site.skip(f"all-to-all is not read through a single wait_tensor (users: {describe_users(node)})")
        rows = fake(x).shape[0]
        if any(isinstance(v, fx.Node) for splits in (out_splits, in_splits) if splits is not None for v in splits):
            if out_splits is None or in_splits is None:
                return site.skip("one split list known only at run time, the other equal: not yet supported")
            # Splits known only at run time (MoE token counts read with .tolist()): blocks cut by them.
            site.blocks = (Blocks(tuple(in_splits), rows), Blocks(tuple(out_splits), fake(node).shape[0]))
            return site
        if not isinstance(rows, int):
            return site.skip(f"dim 0 of {list(fake(x).shape)} is symbolic: its blocks cannot be cut statically")
        even = [rows // n] * n
        if rows % n or [list(s) for s in (out_splits, in_splits) if s is not None and list(s) != even]:
            return site.skip(f"uneven splits (input {in_splits}, output {out_splits} of {rows} rows): not yet supported")
        return site

    def keep_computable(self, site: Site, tensor: list[int]) -> str | None:
        before, after = regions(site, site.group_size, set())
        if before is None and after is None:
            x = site.collective.args[0]
            return (
                f"no row-local compute before or after the all-to-all: nothing to overlap with (its input is "
                f"{x.name} ({target_name(x)}), its result is read by {describe_users(site.wait)})"
            )
        return None

    def schedule_problem(self, schedule: str, m: int) -> str | None:
        if schedule != "ring" or m != 1:
            return "the all-to-all is decomposed pairwise, one block per step: schedule='ring' with chunks_per_rank=1 only"
        return None

    def workload(self, site: Site) -> Workload:
        """The matmuls of both sides (rows cut into the N blocks), and one block's bytes. With
        splits known only at run time: at balanced routing (the static one of the input's and
        the result's row counts, cut into N equal blocks), as every rank assumes alike."""
        before, after = regions(site, site.group_size, set())
        rows = _rows_at_balance(site)
        sides = [[mm for n in (r.computed if r else ()) for mm in _matmuls(n, rows, r.axis[n])] for r in (before, after)]
        x = fake(site.collective.args[0])
        block = rows * math.prod(hinted(size) for size in x.shape[1:]) * x.element_size() // site.group_size
        dtype = x.dtype
        return Workload(self.name, site.group_size, (*sides[0], *sides[1]), block, dtype, before=len(sides[0]), timelines=timelines)

    def emit(self, graph: fx.Graph, site: Site, rank: int, tags: itertools.count, fuse: Fuse) -> None:
        n, r, x = site.group_size, rank, site.collective.args[0]
        sent, received = site.blocks or (None, None)
        before, after = regions(site, n, fuse.reserved - _own(site))
        emit = Emitter(graph, before=site.wait)
        made = Pieces(before) if before else None
        used = Pieces(after) if after else None
        if site.blocks:
            _run_time_sizes(graph, site, emit, r)

        def block(j: int) -> fx.Node:  # block j of the input: computed before, or cut
            return made.piece(emit, x, 0, j) if made else cut(emit, x, 0, j, n, sent)

        def consume(j: int) -> list[fx.Node]:  # the after side on block j of the result
            if used is None:
                return []
            used.give(site.wait, j, out[j])
            return used.compute(emit, j)

        steps = all_to_all_steps(n, r)
        out: list[fx.Node | None] = [None] * n
        ready: list[int] = []
        if made is None:
            out[r] = block(r)
            ready.append(r)
        outgoing = block(steps[0].send_to) if made is not None else None
        exchange = ring_exchange_op()
        for i, mv in enumerate(steps):
            if made is None:  # nothing to compute before: a block of the input
                outgoing = block(mv.send_to)
            rows = () if received is None else (received.sizes[mv.recv_from],)  # (run-time splits: its size)
            start = emit(exchange, outgoing, mv.send_to, mv.recv_from, site.group_name, next(tags), *rows)
            compute = []
            if made is not None:  # the next block to send, or the own block at the last step
                following = steps[i + 1].send_to if i + 1 < len(steps) else r
                outgoing = block(following)
                compute.append(outgoing)
                if following == r:
                    out[r] = outgoing
                    ready.append(r)
            while ready and (made is None or ready[0] != r or i + 1 == len(steps)):
                compute += consume(ready.pop(0))
            wait = emit(WAIT, start)
            out[mv.recv_from] = wait
            ready.append(mv.recv_from)
            site.steps.append(RingStep(chunk=mv.recv_from, compute=compute, start=start, wait=wait))
        for j in ready:  # what arrived last, after its wait
            consume(j)
        result = emit(aten.cat.default, out, 0)
        if used is not None:
            used.assemble(emit)
        if made is not None:
            made.assemble(emit)
        site.wait.replace_all_uses_with(result)
        site.fused = [*(before.computed if before else []), *(after.computed if after else [])]
        sides = [f"{side}{attention_note(region)}: {region.describe()}" for side, region in (("before", before), ("after", after)) if region is not None]
        site.notes.append("fused into the steps: " + ("; ".join(sides) or "nothing (its neighbours are in another site's steps)"))

    def reserved(self, site: Site) -> set[fx.Node]:
        return _own(site)


def timelines(t: Timeline, work: Workload, profile: HardwareProfile, schedule: str, m: int) -> None:
    """The all-to-all's schedules on the cost model's timeline: vanilla (the ops before, the
    all-to-all, the ops after) or the pairwise steps (``ring``, m = 1: the only rewrite)."""
    if schedule == "vanilla":
        ahead, behind = _sides(work)
        comm = collective_seconds(work, profile, work.chunk_bytes)  # (N - 1 blocks out)
        made = t.add("before", COMPUTE, compute_seconds(ahead, profile, 1, 1.0))
        t.add("after", COMPUTE, compute_seconds(behind, profile, 1, 1.0), (t.add("all_to_all", COLLECTIVE, comm, (made,)),))
    elif schedule == "ring":
        _pairwise_steps(t, work, profile)
    else:
        raise ValueError(f"the all-to-all has no {schedule!r} schedule (see AllToAll.schedule_problem)")


def _sides(work: Workload) -> tuple[Workload, Workload]:
    """An all-to-all's workload as the matmuls before it and those after it."""
    return (
        dataclasses.replace(work, matmuls=work.matmuls[: work.before]),
        dataclasses.replace(work, matmuls=work.matmuls[work.before :]),
    )


def _pairwise_steps(t: Timeline, work: Workload, profile: HardwareProfile) -> None:
    """Flash-All-to-All as the rewrite emits it (:func:`all_to_all_steps`): the first block to
    send computed up front, then per step the next block's before-compute and the last
    arrived block's after-compute overlap the step's transfer (one block each way)."""
    n, slow = work.group_size, profile.overlap_slowdown
    ahead, behind = _sides(work)
    made, used = compute_seconds(ahead, profile, n, slow), compute_seconds(behind, profile, n, slow)
    transfer = profile.transfer_seconds(work.chunk_bytes)  # (link-bound: not slowed)
    outgoing = t.add("before[first]", COMPUTE, made) if ahead.matmuls else None
    arrived = None
    for k, _move in enumerate(all_to_all_steps(n, 0)):
        send = t.add(f"send[{k}]", "link+", transfer, (outgoing,))
        step_cost(t, profile, f"[{k}]")
        if ahead.matmuls:
            outgoing = t.add(f"before[{k}]", COMPUTE, made, (outgoing,))
        if behind.matmuls:
            t.add(f"after[{k}]", COMPUTE, used, (arrived,))
        arrived = send
    if behind.matmuls:
        t.add("after[last]", COMPUTE, used, (arrived,))


HOST_READ = aten._local_scalar_dense.default
HOST_READ_DEPTH = 6  # (torchtitan: wait → wait → sum → select → _local_scalar_dense)


def read_on_host(node: fx.Node) -> fx.Node | None:
    """A ``_local_scalar_dense`` (``.item()``, ``.tolist()``) within a few ops after ``node``,
    if any: its result goes to the host, and the host waits for all of it."""
    frontier, seen = [node], {node}
    for _ in range(HOST_READ_DEPTH):
        frontier = list(dict.fromkeys(user for current in frontier for user in current.users if user not in seen))
        seen.update(frontier)
        if (found := next((user for user in frontier if user.target is HOST_READ), None)) is not None:
            return found
    return None


def regions(site: Site, count: int, reserved: set[fx.Node]) -> tuple[Region | None, Region | None]:
    """The row-local ops producing the all-to-all's input and reading its result, block by block."""
    x = site.collective.args[0]
    sent, received = site.blocks or (None, None)
    before = backward_region({x: 0}, count, reserved, [], site.notes, sent)
    after = forward_region(site, {site.wait: 0}, count, reserved, blocks=received, sums=True)
    return before, after


def _run_time_sizes(graph: fx.Graph, site: Site, emit: Emitter, r: int) -> None:
    """What splits known only at run time need before the steps: the own block's two sizes
    made one (:func:`same_own_block`), and the collective's size readers reading the received
    sizes (:func:`read_sizes_from_splits`), so the collective can go."""
    sent, received = site.blocks
    same_own_block(emit, site.collective, sent.sizes[r], received.sizes[r])
    read_sizes_from_splits(graph, site.collective, received)


def same_own_block(emit: Emitter, collective: fx.Node, mine, theirs) -> None:
    """The own block never travels: it is ``mine`` rows (its input split) when cut from the
    input and ``theirs`` (its output split) in the result. Both are the same number (this
    rank's count for itself, on either side of the count exchange), which the shape environment
    cannot know: assert it at run time and tell the environment, so the result has the
    original's size."""
    if mine is theirs or (isinstance(mine, int) and mine == theirs):
        return
    same = emit(operator.eq, mine, theirs)
    emit(aten._assert_scalar.default, same, f"commfuse: {collective.name}: the own block's sizes differ ({mine} != {theirs})")
    with emit.fake_mode:
        torch._check(fake(same))


def read_sizes_from_splits(graph: fx.Graph, collective: fx.Node, received: Blocks) -> None:
    """The collective's size readers (``sym_size(all_to_all, d)``, read before its wait) read
    the sum of the ``received`` sizes (dim 0) or its input's size instead."""
    for reader in [u for u in collective.users if u.target is SYM_SIZE]:
        dim = reader.args[1] % fake(collective).dim()
        size = Emitter(graph, before=reader)
        reader.replace_all_uses_with(size(torch.sym_sum, list(received.sizes)) if dim == 0 else size(SYM_SIZE, collective.args[0], dim))
        graph.erase_node(reader)


def _rows_at_balance(site: Site) -> int:
    """The rows of the input (= of the result) as every rank assumes them: static, or with
    splits known at run time the static one of the two totals (hinted if neither is)."""
    if site.blocks is None:
        return hinted(fake(site.collective.args[0]).shape[0])
    totals = [blocks.total for blocks in site.blocks]
    return next((t for t in totals if isinstance(t, int)), None) or hinted(totals[0])


def _own(site: Site) -> set[fx.Node]:
    return {site.collective, site.wait}


def _matmuls(node: fx.Node, rows_at_balance: int, axis: int) -> list[Matmul]:
    """The matmuls of a region node the cost model times: a matmul itself (cut by rows or
    columns, or contracting over the cut: ``PARTIAL_SUM``); attention (and its backward) cut
    by query rows as the matmuls of its FLOPs."""
    if node.target in MATMULS:
        return [_matmul(node, rows_at_balance, "k" if axis == PARTIAL_SUM else "m")]
    if (products := ATTENTION_PRODUCTS.get(node.target)) is not None:
        return [_attention_matmul(node)] * products
    return []


# Attention's [L, E] @ [E, S]-sized products per head: QK and PV forward; the CPU flash backward
# recomputes QK, then dP = dO·V, dV, dQ and dK.
ATTENTION_PRODUCTS = {**dict.fromkeys(ATTENTION, 2), **dict.fromkeys(ATTENTION_BACKWARD, 5)}


def _attention_matmul(node: fx.Node) -> Matmul:
    """One product of attention per head as one matmul: rows are query rows of every batch and
    head, the keys seen are halved when causal (on average a query row sees half of them)."""
    named = arguments(node.target, node.args, node.kwargs)  # (the forward and backward ops name them alike)
    batch, heads, queries, depth = hinted_shape(named["query"])
    keys = hinted_shape(named["key"])[2]
    return Matmul(batch * heads * queries, depth, max(keys // 2 if named["is_causal"] else keys, 1), "m")


def _matmul(node: fx.Node, rows_at_balance: int, split: str) -> Matmul:
    rows, cols = fake(node).shape
    rows = rows if isinstance(rows, int) else rows_at_balance  # (cut by the run-time splits)
    return Matmul(rows, hinted_shape(left_operand(node))[-1], hinted(cols), split)
