"""The pass's own cost grows with the graph, not with the graph times its sites.

Every stage that needs the whole graph walks it a fixed number of times per compile (find the
collectives, sort once, lint); per site, only the nodes next to it are visited: fusion regions
grow from the ring outwards, dependency questions stop at the nodes before the ring, and each
rewrite keeps the graph sorted itself (no re-sort or dead-code pass of the whole graph per
site). Counted, not timed: the walks over the compiled graph's node list during the pass, for a
stack of 1 and of 3 Llama-style blocks (8 and 24 rewritten sites).
"""

from __future__ import annotations

import torch
import torch.fx.graph as fx_graph
from conftest import fake_world

import commfuse_compile
import commfuse_compile.passes as passes
from commfuse_compile.models import Block, tp_plan

DIM, HEADS, FFN, BATCH, SEQ_PER_RANK, WORLD = 64, 8, 128, 2, 4, 4


def _stack(blocks: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    stack = torch.nn.Sequential(*(Block(DIM, HEADS, FFN) for _ in range(blocks)))
    plan = {key: style for i in range(blocks) for key, style in tp_plan(f"{i}.").items()}
    return parallelize_module(stack, init_device_mesh("cpu", (WORLD,)), plan)


def walks_per_graph(blocks: int, monkeypatch) -> tuple[dict[str, int], int]:
    """How often the pass iterated over each graph's node list, by graph kind; sites rewritten."""
    walks: dict[str, int] = {}
    current: list = []  # (graph, kind) of the pipeline running now
    iterate = fx_graph._node_list.__iter__

    def counted_iter(nodes):
        if current and nodes.graph is current[0][0]:
            walks[current[0][1]] = walks.get(current[0][1], 0) + 1
        return iterate(nodes)

    run_pipeline = passes.run_pipeline

    def counted_pipeline(graph, options, kind, *args, **kwargs):
        current.append((graph, kind))
        try:
            return run_pipeline(graph, options, kind, *args, **kwargs)
        finally:
            current.clear()

    monkeypatch.setattr(fx_graph._node_list, "__iter__", counted_iter)
    monkeypatch.setattr(passes, "run_pipeline", counted_pipeline)
    with fake_world(WORLD):
        x = torch.randn(BATCH, SEQ_PER_RANK, DIM, requires_grad=True)
        report = commfuse_compile.explain(_stack(blocks), x, options={"schedule": "ring"}, codegen=False)
    monkeypatch.undo()
    return walks, len(report.rewritten)


def test_whole_graph_walks_do_not_grow_with_the_sites(monkeypatch):
    one, sites_one = walks_per_graph(1, monkeypatch)
    three, sites_three = walks_per_graph(3, monkeypatch)
    assert (sites_one, sites_three) == (8, 24)
    assert set(one) == {"forward", "backward"}
    assert three == one, f"walks over the graph per compile: 1 block {one}, 3 blocks {three}"
