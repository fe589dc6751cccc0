"""The ring transport on its own (``commfuse_compile.p2p``), in one process under the fake
process group: what ``ring_exchange`` hands to the process group, and what its wait returns."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commfuse_compile.p2p import WAIT_EXCHANGE, ring_exchange
from conftest import fake_world


@pytest.fixture
def handed_over(monkeypatch) -> list[dist.P2POp]:
    """The point-to-point ops ``ring_exchange`` starts (not started: nothing to wait on)."""
    ops: list[dist.P2POp] = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda p2p_ops: ops.extend(p2p_ops) or [])
    return ops


def test_a_contiguous_tensor_is_sent_as_it_is(handed_over):
    with fake_world(4) as group:
        sent = torch.randn(6, 8)
        received = ring_exchange(sent, 1, 3, group.group_name, 7)
    send, recv = handed_over
    assert send.op is dist.isend and send.tensor is sent  # no copy: the graph keeps it until the wait
    assert (send.group_peer, recv.group_peer, send.tag, recv.tag) == (1, 3, 7, 7)
    assert recv.op is dist.irecv and recv.tensor is received and received.data_ptr() != sent.data_ptr()


def test_a_strided_tensor_is_sent_as_a_contiguous_copy(handed_over):
    with fake_world(2) as group:
        base = torch.randn(6, 8)
        ring_exchange(base[:, 2:5], 1, 1, group.group_name, 1)
    send, _ = handed_over
    assert send.tensor.is_contiguous() and torch.equal(send.tensor, base[:, 2:5])
    assert send.tensor.data_ptr() != base.data_ptr()


def test_the_wait_returns_the_received_buffer_and_is_never_dead_code():
    received, sent = torch.randn(3, 4), torch.randn(3, 4)
    waited = WAIT_EXCHANGE(received, sent)
    assert waited.data_ptr() == received.data_ptr() and torch.equal(waited, received)
    graph = torch.fx.Graph()
    r, s = graph.placeholder("received"), graph.placeholder("sent")
    graph.call_function(WAIT_EXCHANGE, (r, s))
    graph.output(None)
    graph.eliminate_dead_code()
    assert any(node.target is WAIT_EXCHANGE for node in graph.nodes)
