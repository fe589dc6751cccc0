"""``Site``: the one data type that flows through the pipeline.

match creates a Site for every collective it inspects; plan sets ``decision`` and ``reason``;
rewrite fills ``steps``; order pins them; report turns the Site into a record.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

import torch
import torch.fx as fx

from .graph_utils import fake, left_operand, right_operand

if TYPE_CHECKING:
    from .rowlocal import Blocks

PatternName = Literal["all_gather_matmul", "matmul_reduce_scatter", "all_reduce", "all_to_all", "moe_ep"]
Decision = Literal["pending", "rewrite", "skip"]


@dataclasses.dataclass
class Consumer:
    """One matmul (``aten.mm`` or ``aten.addmm``) around the collective.

    Flash-AG: a matmul whose left operand is the gathered tensor; ``view`` is the reshape
    between them (``None`` when the matmul reads it directly). Flash-RS: one term of the sum
    that is scattered (``view`` unused: reshapes and adds between the terms and the collective
    are linear, so each term is cut the same way).
    """

    mm: fx.Node
    views: tuple[fx.Node, ...] = ()  # Flash-AG: reshapes from the gathered tensor to the matmul
    # Flash-AG only: what the gathered dim is to the matmul. "rows": rows of the left operand
    # (chunks of output rows); "columns": columns of the right operand through a transpose
    # (FSDP-style weight gather: chunks of output columns); "contraction": the contracted dim
    # (each chunk gives a partial product, summed).
    role: str = "rows"
    # Flash-AG only: the ``permute(·, [1, 0])`` chain between view and matmul (FSDP's
    # reshard-after-forward backward reads ``W.t().t()``); an odd count is a transpose.
    permutes: tuple[fx.Node, ...] = ()
    # Flash-AG only: which axis of the gathered tensor's 2-D view is gathered: 0, its rows (every
    # dim but the last flattened), or 1, its last dim (a gather along the contraction dim of
    # ``AG(A, dim=-1) @ B``).
    gathered_axis: int = 0
    # Flash-AG only: the node the matmul reads the gathered rows through when row-local ops
    # come between them (the gathered tensor's prologue: a residual add, a norm), computed on
    # each piece before the matmul; None when it reads the gathered tensor itself.
    source: fx.Node | None = None

    @property
    def view(self) -> fx.Node | None:
        """The last reshape before the matmul (or its transposes), if any."""
        return self.views[-1] if self.views else None

    @property
    def transposed(self) -> bool:
        return len(self.permutes) % 2 == 1

    def reads(self, gathered: fx.Node) -> fx.Node:
        """Flash-AG: the node the matmul reads in place of the gathered tensor."""
        return self.permutes[-1] if self.permutes else self.view or self.source or gathered

    def operand_shape_of(self, gathered: fx.Node) -> fx.Node:
        """Flash-AG: the node whose shape is the matmul's view of the gathered rows."""
        return self.view or self.source or gathered

    def other_operand(self, gathered: fx.Node) -> fx.Node:
        """Flash-AG: the matmul operand that is not (derived from) the gathered tensor."""
        reads = self.reads(gathered)
        return right_operand(self.mm) if left_operand(self.mm) is reads else left_operand(self.mm)


@dataclasses.dataclass
class RingStep:
    """One emitted ring step: the transfer started, the matmul it overlaps, the wait after it."""

    chunk: int  # which chunk of the gathered / scattered tensor this step computes
    compute: list[fx.Node]  # the chunk matmul(s)
    start: fx.Node | None = None  # ring_exchange overlapping this step's compute, if any
    wait: fx.Node | None = None  # wait_tensor of that exchange, pinned after ``compute``


@dataclasses.dataclass
class Site:
    """A collective the pass looked at, and what became of it."""

    pattern: PatternName  # the pattern's one name (passes.PATTERNS)
    graph: str  # "forward" | "backward" | "inference"
    collective: fx.Node
    wait: fx.Node | None
    group_name: str
    group_size: int
    # The logical tensor: the gathered tensor (after any split/cat that moves the gathered dim)
    # or the tensor that is scattered (before it), and the dim that is gathered / scattered.
    tensor: fx.Node | None = None
    dim: int = 0
    # The permutation between the logical tensor and the collective's layout (movedim before a
    # reduce-scatter, after an all-gather), None if there is none: all-gather, the logical chunk
    # is the shard permuted so; reduce-scatter, the result is the logical chunk permuted so.
    permutation: tuple[int, ...] | None = None
    layout: list[fx.Node] = dataclasses.field(default_factory=list)  # copies / permutes between them
    # Flash-AG: the dtype the gathered chunks are viewed as between the split and the cat (fp8
    # transferred as uint8), None if they are not: pieces travel as the collective's dtype and
    # are computed on as this one.
    chunk_dtype: torch.dtype | None = None
    reduce_op: str = "sum"  # reduce-scatter: "sum" or "avg"
    # All-to-all with split sizes known only at run time: the N blocks of its input and of its
    # result along dim 0 (:class:`~.rowlocal.Blocks`), None where the splits are static.
    blocks: tuple[Blocks, Blocks] | None = None
    consumers: list[Consumer] = dataclasses.field(default_factory=list)
    # Flash-AG: the row-local ops between the gathered tensor and its consumers' sources
    # (computed on each piece before the matmuls: :mod:`.prologue`).
    prologue: list[fx.Node] = dataclasses.field(default_factory=list)
    shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    decision: Decision = "pending"
    reason: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    # Set by plan: the schedule, m (pieces per chunk; slices for "slicing"), the cost model's
    # profile and its estimate per candidate (label -> seconds).
    schedule: str = "ring"
    chunks_per_rank: int = 1
    profile: str | None = None
    estimates: dict[str, float] = dataclasses.field(default_factory=dict)
    rank: int | None = None  # this rank's index in the group, set by rewrite
    fused: list[fx.Node] = dataclasses.field(default_factory=list)  # original ops now computed inside the steps
    region: list[str] = dataclasses.field(default_factory=list)  # names of the nodes the rewrite emitted
    emitted: list[fx.Node] = dataclasses.field(default_factory=list, repr=False)  # those nodes
    modeled: tuple = ()  # cost_model.Estimate of vanilla and of the chosen (or best) schedule
    steps: list[RingStep] = dataclasses.field(default_factory=list)
    # Which collective this is, in terms that survive the graph being put back and matched again
    # (node names do not): its index among the graph's matched collectives, and for the halves
    # of a split all-reduce, which half. Set by the pipeline.
    key: tuple = ()

    def skip(self, reason: str) -> Site:
        self.decision, self.reason = "skip", reason
        return self


def symbolic_problem(site: Site) -> str | None:
    """Why symbolic sizes keep the site from being cut, if they do. Pieces are cut along the
    site's dim at sizes baked into the code, so that dim must be static; other dims (a batch
    that ``torch.compile`` made dynamic) may be symbolic, one per tensor (it becomes the -1 of
    each reshape). An all-to-all with run-time splits is cut by its split sizes instead."""
    if site.blocks is not None:
        return None
    shape = fake(site.tensor).shape
    if not isinstance(shape[site.dim], int):
        return f"dim {site.dim} of {list(shape)} has the symbolic size {shape[site.dim]}: its pieces cannot be cut statically"
    symbolic = [str(s) for s in shape if not isinstance(s, int)]
    if len(symbolic) > 1:
        return f"{list(shape)} has more than one symbolic size ({', '.join(symbolic)}): not yet supported"
    return None


def coalesced_site(pattern: PatternName, node: fx.Node, graph_kind: str) -> Site:
    """A coalesced collective (several tensors in one call): recorded, left alone."""
    group_size, group_name = node.args[-2:]  # both coalesced ops end with (group_size, group_name)
    site = Site(pattern, graph_kind, node, None, group_name, group_size)
    return site.skip("coalesced collective (several tensors in one call): not yet supported")
