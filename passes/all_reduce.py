"""Pattern ``all_reduce``: an all-reduce between matmuls, split into Flash-RS and Flash-AG.

Plain tensor parallelism (Megatron without sequence parallelism, Hugging Face's TP plans)
all-reduces the output of every row-parallel linear, and the next column-parallel linears read
the sum through row-local ops (residual add, RMSNorm); backward does the same for the input
gradient of every column-parallel linear. An all-reduce is a reduce-scatter followed by an
all-gather, and each half then has a matmul beside it.

Matches (post-grad aten graph, functional collectives)::

    all_reduce(x, "sum" | "avg", group) -> wait_tensor       x: [..., H], some dim d of its
                                                             leading dims splits into N pieces

Splits it (in the forms ``funcol.reduce_scatter_tensor`` / ``all_gather_tensor`` trace to on dim
d, the largest leading dim that N divides)::

    s = wait(reduce_scatter(cat(split(x, N, d), 0), op, N))      # this rank's rows of the sum
    y = cat(split(wait(all_gather(s, N)), N, 0), d)             # every rank's rows again

and hands the halves to :mod:`.matmul_reduce_scatter` (the matmul producing ``x``: Flash-RS)
and :mod:`.all_gather_matmul` (the matmuls reading ``y``, through the row-local ops before them
computed on each arriving piece: Flash-AG with a prologue, :mod:`.prologue`). Each half is
planned, timed by the cost model and recorded as a site of its own pattern, with a note naming
the all-reduce; the all-reduce is recorded as rewritten when a half is. When neither half can
be decomposed, the all-reduce is put back as it was, and its skip gives both halves' reasons.

Exact: the sum is the same, only summed in another order (by the ring, not by the collective).
"""

from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from commfuse_compile._compat import resolve_process_group

from .graph_utils import ALL_GATHER, REDUCE_SCATTER, WAIT, Emitter, aten, c10d, describe_users, fake, recording, shape_of
from .layout import single_wait
from .pattern import Pattern
from .site import Site

ALL_REDUCE = c10d.all_reduce.default


class AllReduce(Pattern):
    name = "all_reduce"
    flash = "Flash-RS + Flash-AG"
    option = "flash_ar"
    collectives = frozenset({ALL_REDUCE})
    splits_into = ("matmul_reduce_scatter", "all_gather_matmul")  # (planned and timed as those)

    def match(self, node: fx.Node, graph_kind: str) -> Site:
        tensor, reduce_op, group_name = node.args[:3]
        group_size = resolve_process_group(group_name).size()
        site = Site(self.name, graph_kind, node, single_wait(node), group_name, group_size)
        site.shapes["input"] = shape_of(tensor)
        site.tensor = tensor
        if site.wait is None:
            return site.skip(f"all-reduce is not read through a single wait_tensor (users: {describe_users(node)})")
        if reduce_op not in ("sum", "avg"):
            return site.skip(f"reduce op {reduce_op!r}: only 'sum' and 'avg' split into a reduce-scatter")
        site.reduce_op = reduce_op
        shape = fake(tensor).shape
        dims = [d for d in range(len(shape) - 1) if isinstance(shape[d], int) and shape[d] % group_size == 0]
        if not dims:
            return site.skip(f"no dim of {list(shape)} but the last splits into {group_size} pieces: nothing to scatter")
        site.dim = max(dims, key=lambda d: (shape[d], -d))
        return site

    def emit(self, graph: fx.Graph, site: Site, rank: int, tags, fuse) -> None:
        """Nothing of its own: the split (:func:`split`) left two collectives, emitted by their
        own patterns."""


@dataclasses.dataclass
class Split:
    """An all-reduce split into its halves, and how to put it back."""

    site: Site
    scatter: fx.Node  # the reduce_scatter_tensor
    gather: fx.Node  # the all_gather_into_tensor
    output: fx.Node  # what the all-reduce's readers read now
    emitted: list[fx.Node]


def split(graph: fx.Graph, site: Site) -> Split:
    """Replace the all-reduce of ``site`` by a reduce-scatter and an all-gather on its dim."""
    with recording(graph) as emitted:
        scatter, gather, output = _split_in_halves(graph, site)
    return Split(site, scatter, gather, output, emitted)


def _split_in_halves(graph: fx.Graph, site: Site) -> tuple[fx.Node, fx.Node, fx.Node]:
    x, n, d, group = site.tensor, site.group_size, site.dim, site.group_name
    emit = Emitter(graph, before=site.wait)
    size = fake(x).shape[d] // n
    stacked = x if d == 0 else emit(aten.cat.default, _pieces(emit, x, size, d, n), 0)
    scatter = emit(REDUCE_SCATTER, stacked, site.reduce_op, n, group)
    rows = emit(WAIT, scatter)
    gather = emit(ALL_GATHER, rows, n, group)
    gathered = emit(WAIT, gather)
    output = gathered if d == 0 else emit(aten.cat.default, _pieces(emit, gathered, fake(rows).shape[0], 0, n), d)
    site.wait.replace_all_uses_with(output)
    graph.erase_node(site.wait)
    graph.erase_node(site.collective)
    return scatter, gather, output


def restore(graph: fx.Graph, undo: Split) -> None:
    """Put the all-reduce back in place of its halves (a new node: the old one was erased)."""
    site = undo.site
    emit = Emitter(graph, before=undo.scatter)
    site.collective = emit(ALL_REDUCE, site.tensor, site.reduce_op, site.group_name)
    site.wait = emit(WAIT, site.collective)
    undo.output.replace_all_uses_with(site.wait)
    for node in reversed(undo.emitted):
        graph.erase_node(node)


def settle(undo: Split, halves: list[Site]) -> bool:
    """The all-reduce's decision from its halves' (True: keep the split)."""
    site = undo.site
    words = {"matmul_reduce_scatter": "a reduce-scatter", "all_gather_matmul": "an all-gather"}
    for half in halves:
        half.notes.append(f"half of {site.collective.name} ({site.graph} all-reduce split on dim {site.dim})")
    if not any(h.decision == "rewrite" for h in halves):
        site.skip("neither half can be decomposed: " + "; ".join(f"{words[h.pattern].split()[1]}: {h.reason}" for h in halves))
        return False
    site.decision = "rewrite"
    done = next(h for h in halves if h.decision == "rewrite")
    site.schedule, site.chunks_per_rank, site.profile = done.schedule, done.chunks_per_rank, done.profile
    site.reason = f"split on dim {site.dim} into " + " and ".join(
        f"{words[h.pattern]} ({h.reason if h.decision == 'rewrite' else 'left as is: ' + h.reason})" for h in halves
    )
    return True


def _pieces(emit: Emitter, tensor: fx.Node, size: int, dim: int, n: int) -> list[fx.Node]:
    parts = emit(aten.split.Tensor, tensor, size, dim)
    return [emit(operator.getitem, parts, i) for i in range(n)]
