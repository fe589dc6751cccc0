"""Outlined ring steps: one compiled body per piece shape, so kernels do not grow with the ring.

A Llama-style TP + SP block (forward + backward) is compiled under the fake process group at
several world sizes, and the kernels Inductor generates are counted by
their sources (what its compiler compiles). With the steps outlined the count does not grow
with the world size; inline, each step's kernels carry its piece's offset and the count grows.
Numerical equality with eager, outlined, is checked on gloo ranks in ``test_rings.py``.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator

import pytest
import torch
from torch._inductor.async_compile import AsyncCompile

from commfuse_compile.models import Block, tp_plan
from commfuse_compile.passes.outline import INVOKE
from conftest import fake_world
from graphs import post_grad_graphs, rewrite_as

DIM, HEADS, FFN, BATCH, SEQ_PER_RANK = 64, 8, 128, 2, 4


@contextlib.contextmanager
def kernel_sources() -> Iterator[list[str]]:
    """Every C++ kernel source the generated code defines while inside (one per definition)."""
    sources: list[str] = []
    original = AsyncCompile.cpp_pybinding

    def counted(self, argtypes, source):
        sources.append(source)
        return original(self, argtypes, source)

    AsyncCompile.cpp_pybinding = counted
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            yield sources
    finally:
        AsyncCompile.cpp_pybinding = original


def _block(world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    stack = torch.nn.Sequential(Block(DIM, HEADS, FFN))
    return parallelize_module(stack, init_device_mesh("cpu", (world,)), tp_plan("0."))


def unique_kernels(world: int, **options) -> tuple[int, list]:
    """Distinct kernel sources of one block's forward + backward at ``world``, and the reports."""
    import commfuse_compile

    with fake_world(world):
        torch._dynamo.reset()
        commfuse_compile.clear_reports()
        model = torch.compile(_block(world), backend="commfuse", options={"schedule": "ring", "outline": True, **options})
        x = torch.randn(BATCH, SEQ_PER_RANK, DIM, requires_grad=True)
        with kernel_sources() as sources:
            model(x).sum().backward()
        reports = commfuse_compile.reports()
        torch._dynamo.reset()
    assert sum(s.rewritten for r in reports for s in r.sites) == 8  # (2 AG + 2 RS, forward and backward)
    return len(set(sources)), reports


@pytest.mark.slow
def test_kernels_do_not_grow_with_the_ring():
    counts = [unique_kernels(world)[0] for world in (2, 4, 8)]
    assert counts == sorted(counts, reverse=True), counts  # (pieces of one size may coincide)
    inline = unique_kernels(8, outline=False)[0]
    assert inline > counts[-1], (inline, counts)  # what outlining saves at world size 8


def test_steps_call_one_shared_body(world):
    """At world size 8 every step of a Flash-AG / Flash-RS ring (but attention's, whose pieces
    see different numbers of keys) is one ``invoke_subgraph`` of a body shared by the ring's
    steps, the transfer started before it passed as its last input."""
    inputs = [torch.randn(2, 4, DIM), torch.randn(3, DIM, DIM), torch.randn(DIM, DIM)]
    graphs = post_grad_graphs(_mlp, *(t.requires_grad_() for t in inputs))
    for kind, graph in graphs.items():
        rewritten, sites, _ = rewrite_as(graph, 3, kind, outline=True, pin_order=False)
        calls = [n for n in rewritten.nodes if n.target is INVOKE]
        assert calls and all(s.decision == "rewrite" for s in sites)
        for site in sites:
            started = [step for step in site.steps if step.start is not None]
            assert all(step.outlined is not None for step in site.steps), (kind, site.pattern, site.notes)
            assert len({step.outlined.args[0].target for step in started}) == 1  # one body for the ring's steps
            for step in started:
                assert step.outlined.args[-1] is step.start
                assert all(c.target is operator.getitem and c.args[0] is step.outlined for c in step.compute)
            assert any("steps outlined" in note for note in site.notes)
        bodies = {n.target for n in rewritten.nodes if n.op == "get_attr" and n.target.startswith("commfuse_step_body")}
        assert len(bodies) < len(calls)


def _mlp(x, w_in, w_out):
    """Sequence-parallel: gather [B, S/N, H] on S, three projections, silu-gated, the output
    projection reduce-scattered on S."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    group = torch.distributed.group.WORLD
    h = funcol.all_gather_tensor(x, 1, group)
    a, b, c = (h @ w for w in w_in.unbind(0))
    return funcol.reduce_scatter_tensor((F.silu(a) * b + c) @ w_out, "sum", 1, group)


@pytest.fixture(scope="module")
def world():
    with fake_world(8, rank=0) as group:
        yield group
