"""NCCL matches the messages between two ranks in the order they are issued and ignores tags.

So on every pair of ranks (a, b), the k-th send from a to b must meet the k-th receive on b from
a (same shape, dtype and logical exchange), and every rank must issue the group's collectives in
one order. Read from every rank's rewritten graph under the fake process group at world sizes
2, 4 and 8, for every schedule and m, forward and backward, on programs with Flash-AG and
Flash-RS (dim 0 and the sequence dim), a split all-reduce and Flash-All-to-All; the graph order
is the issue order because each start is pinned after the one before it (checked too). At world
size 2 both directions of the bidirectional ring reach the same peer: only the order keeps them
apart.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import fake_world
from graphs import CONTROL_DEPS, RING_EXCHANGE, is_collective, post_grad_graphs, rewrite_as, unpinned

import programs

PROGRAMS = ["canonical", "sequence_parallel", "plain_tp", "expert_parallel", "ulysses"]
SCHEDULES = [("ring", 1), ("ring", 2), ("bidirectional", 1), ("bidirectional", 2), ("slicing", 1), ("slicing", 2)]


def issued(graph: torch.fx.Graph) -> tuple[list[tuple], list[tuple]]:
    """This rank's point-to-point messages, (peer, direction, shape, dtype, tag) in issue
    order, and its collectives, (op, shape, dtype). The tag names the logical exchange (one
    per ring step of a site, the same on every rank): gloo matches by it, NCCL does not, so the
    order must pair the same messages the tags would."""
    messages, collectives = [], []
    for node in graph.nodes:
        target, args = unpinned(node)
        value = args[0].meta["val"] if args and isinstance(args[0], torch.fx.Node) else None
        if target is RING_EXCHANGE:
            sent, send_to, recv_from, tag = value, args[1], args[2], args[4]
            messages.append((send_to, "send", tuple(sent.shape), sent.dtype, tag))
            messages.append((recv_from, "recv", tuple(sent.shape), sent.dtype, tag))  # (same shape both ways)
        elif is_collective(target):
            collectives.append((target.__name__, tuple(value.shape), value.dtype))
    return messages, collectives


def _is_start(node: torch.fx.Node) -> bool:
    target, _ = unpinned(node)
    return target is RING_EXCHANGE or is_collective(target)


def check_pinned(graph: torch.fx.Graph) -> None:
    """Each start (ring exchange or collective) is pinned after the one before it, so a
    scheduler issues them in graph order."""
    starts = [n for n in graph.nodes if _is_start(n)]
    for before, after in zip(starts, starts[1:]):
        assert after.target is CONTROL_DEPS and before in after.args[0], (before, after)


def check_pairs(per_rank: list[tuple[list[tuple], list[tuple]]]) -> int:
    """Assert every send meets its receive in position (same shape, dtype and logical
    exchange); returns the number of messages."""
    world = len(per_rank)
    for a, b in itertools.permutations(range(world), 2):
        sends = [message[2:] for message in per_rank[a][0] if message[:2] == (b, "send")]
        receives = [message[2:] for message in per_rank[b][0] if message[:2] == (a, "recv")]
        assert sends == receives, f"rank {a} -> rank {b}: sends {sends} vs receives {receives}"
    collectives = [c for _, c in per_rank]
    assert all(c == collectives[0] for c in collectives), collectives
    return sum(kind == "send" for messages, _ in per_rank for _, kind, *_ in messages)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("program", PROGRAMS)
def test_every_send_meets_its_receive_in_issue_order(world, program):
    with fake_world(world):  # (the pass resolves the group's size through it)
        inputs = programs.make_inputs(program, 0, world, torch.float32)
        graphs = post_grad_graphs(programs.PROGRAMS[program][0], *inputs)
        assert set(graphs) == {"forward", "backward"}
        rewritten_somewhere = 0
        for (kind, graph), (schedule, m) in itertools.product(graphs.items(), SCHEDULES):
            per_rank, rewrites = [], set()
            for rank in range(world):
                rewritten, sites, _ = rewrite_as(graph, rank, kind, schedule=schedule, chunks_per_rank=m)
                per_rank.append(issued(rewritten))
                if any(s.steps for s in sites):
                    check_pinned(rewritten)
                rewrites.add(tuple(s.decision for s in sites))
            rewritten_somewhere += _check(kind, schedule, m, per_rank, rewrites) > 0
    assert rewritten_somewhere >= 2  # forward and backward rewritten under some schedule


def _check(kind: str, schedule: str, m: int, per_rank: list, rewrites: set) -> int:
    """The checks of one graph under one plan on every rank; returns the number of sends."""
    assert len(rewrites) == 1, f"{kind} {schedule} m={m}: ranks decided differently: {rewrites}"
    messages = check_pairs(per_rank)
    if "rewrite" in next(iter(rewrites)) and schedule != "slicing":
        assert messages > 0, (kind, schedule, m)  # (a rewritten ring sends)
    return messages
