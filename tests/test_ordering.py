"""Ordering rings that read each other's results — single process, fake process group.

Under torchtitan's default selective activation checkpointing, a block's backward holds four
all-gathers and two reduce-scatters whose rings read each other's products: the recomputed
activations and the gradients are gathered by two rings, and each one's matmuls read the
other's results. Pinned in the order the rewrites left (one ring wholly before the other),
the graph had a cycle: every backward site fell back to its collective with an empty
``AssertionError``. The graphs here are torchtitan's own, through ``parallelize_llama``
(``tests/titan_trainer.py``); each rank's rewritten graph is then run in its order by a small
model of the transports (:func:`run_in_graph_order`) that finds a deadlock if one exists.
"""

from __future__ import annotations

import collections
import re

import pytest
import torch
import torch.fx as fx
from conftest import fake_world
from graphs import RING_EXCHANGE, _Capture, is_collective, rewrite_as, unpinned
from torch._inductor.compile_fx import compile_fx

import commfuse_compile.passes.order as order
from commfuse_compile.explain import _post_grad_only
from commfuse_compile.p2p import WAIT_EXCHANGE
from commfuse_compile.passes.graph_utils import WAIT


def selective_ac_backward(tp: int) -> fx.Graph:
    """The block's backward graph of torchtitan's Llama3 under TP=``tp`` and its default SAC."""
    import titan_trainer

    capture = _Capture()

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=_post_grad_only, config_patches={"post_grad_custom_post_pass": capture, "fx_graph_cache": False})

    torch._dynamo.reset()
    training = titan_trainer.build("llama3", backend, tp=tp, ac="selective", n_layers=1)
    with training.context():
        pred = training.model(training.tokens)
        loss, _ = training.loss_fn(pred, training.labels, training.global_valid_tokens)
        loss.backward()
    backwards = [graph for kind, graph in capture.graphs if kind == "backward"]
    return max(backwards, key=lambda graph: len(graph.nodes))  # (the block's, not the loss's)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def sac(request):
    with fake_world(request.param):
        yield request.param, selective_ac_backward(request.param)


def test_selective_ac_backward_is_rewritten_and_runs_without_deadlock(sac):
    tp, graph = sac
    rewritten = []
    for rank in range(tp):
        result, sites, report = rewrite_as(graph, rank, "backward")
        assert [(s.pattern, s.decision) for s in sites] == [("all_gather_matmul", "rewrite")] * 2 + [("matmul_reduce_scatter", "rewrite")] + [
            ("all_gather_matmul", "rewrite")
        ] * 2 + [("matmul_reduce_scatter", "rewrite")], [(s.pattern, s.reason) for s in sites]
        assert not report.errors
        rewritten.append(result)
    run_in_graph_order(rewritten)


def test_rings_that_cannot_be_ordered_leave_the_later_one_alone(sac, monkeypatch):
    """Without the exact parts of the gathered results (a piece read through a view the pass
    cannot undo), two rings need each other's results: the later is left to its collective,
    with that reason; the other five stay rewritten, and the graph still runs."""
    tp, graph = sac
    monkeypatch.setattr(order, "part_of_cat", lambda *args: None)
    rewritten = []
    for rank in range(tp):
        result, sites, report = rewrite_as(graph, rank, "backward")
        skipped = [s for s in sites if s.decision == "skip"]
        assert len(skipped) == 1 and len(sites) == 6, [(s.collective.name, s.decision) for s in sites]
        assert re.match(r"its steps and those of all_gather_into_tensor(_\d+)?'s ring need each other's results", skipped[0].reason), skipped[0].reason
        assert "left to the plain collective" in skipped[0].reason
        assert not report.errors  # (a decision, not a failure: strict does not raise for it)
        rewritten.append(result)
    run_in_graph_order(rewritten)
    rewrite_as(graph, 0, "backward", strict=True)


def test_a_skipped_site_keeps_its_name_in_the_restored_graph(sac, monkeypatch):
    """The pipeline puts the graph back before it leaves a ring alone: the collective is the
    original node (same name), not a copy."""
    tp, graph = sac
    monkeypatch.setattr(order, "part_of_cat", lambda *args: None)
    _, sites, _ = rewrite_as(graph, 0, "backward")
    (skipped,) = [s for s in sites if s.decision == "skip"]
    assert skipped.collective.name in {n.name for n in graph.nodes}


def run_in_graph_order(graphs: list[fx.Graph]) -> None:
    """Run every rank's graph in its node order against a model of the transports, failing on a
    deadlock. A ring exchange posts its send and its receive and returns; its wait needs the
    peer's matching send (same pair of ranks and tag, in order) and the receiver's matching
    receive posted. A collective starts; its wait needs every rank to have started it."""
    ranks = len(graphs)
    nodes = [list(graph.nodes) for graph in graphs]
    at = [0] * ranks
    posted = collections.Counter()  # (sender, receiver, tag) → messages posted so far
    exchanges = [{} for _ in range(ranks)]  # start's name → (its message out, its message in), numbered
    started = [[] for _ in range(ranks)]  # names of the collectives started, in order
    # (by name: a pinned node's op reads its inputs through its subgraph's placeholders)
    while True:
        moved = False
        for rank in range(ranks):
            while at[rank] < len(nodes[rank]):
                node = nodes[rank][at[rank]]
                target, args = unpinned(node)
                if target is RING_EXCHANGE:
                    _, send_to, recv_from, _, tag = args
                    out, into = (rank, send_to, tag), (recv_from, rank, tag)
                    posted[out] += 1
                    posted[("recv",) + into] += 1
                    exchanges[rank][node.name] = (out, posted[out], into, posted[("recv",) + into])
                elif target is WAIT_EXCHANGE:
                    out, n_out, into, n_in = exchanges[rank][args[0].name]
                    if posted[into] < n_in or posted[("recv",) + out] < n_out:
                        break  # (its message has not been sent, or its peer does not receive yet)
                elif is_collective(target):
                    started[rank].append(node.name)
                elif target is WAIT and args[0].name in started[rank]:  # (else started by an earlier graph)
                    index = started[rank].index(args[0].name)
                    if any(len(started[other]) <= index for other in range(ranks)):
                        break
                at[rank] += 1
                moved = True
        if all(at[rank] == len(nodes[rank]) for rank in range(ranks)):
            return
        if not moved:
            blocked = {rank: nodes[rank][at[rank]].name for rank in range(ranks) if at[rank] < len(nodes[rank])}
            raise AssertionError(f"deadlock: ranks blocked at {blocked}")


def test_the_deadlock_model_finds_a_deadlock():
    """Two ranks that wait on each other's second message before sending it."""

    def rank_graph(peer: int, first_tag: int, second_tag: int) -> fx.Graph:
        graph = fx.Graph()
        x = graph.placeholder("x")
        a = graph.call_function(RING_EXCHANGE, (x, peer, peer, "g", first_tag))
        graph.call_function(WAIT_EXCHANGE, (a, x))
        b = graph.call_function(RING_EXCHANGE, (x, peer, peer, "g", second_tag))
        graph.call_function(WAIT_EXCHANGE, (b, x))
        return graph

    run_in_graph_order([rank_graph(1, 1, 2), rank_graph(0, 1, 2)])
    with pytest.raises(AssertionError, match="deadlock"):
        run_in_graph_order([rank_graph(1, 1, 2), rank_graph(0, 2, 1)])
