"""Fusion of row-local ops into the ring steps, read back from rewritten graphs (fake process
group, world size 4, every rank). Numerics are checked on real ranks in test_rings.py
(``row_local``, ``attention``) and test_tp_llama.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from conftest import fake_world
from graphs import attention_calls, post_grad_graphs, query_split_calls, rewrite_as, unpinned

from commfuse_compile.passes.attention import CPU_FLASH
from commfuse_compile.passes.rowlocal import reshape_axis
from commfuse_compile.passes.graph_utils import MATMULS, MM, fake

WORLD = 4


@pytest.fixture(scope="module")
def world():
    with fake_world(WORLD, rank=0) as group:
        yield group


@pytest.mark.parametrize(
    "shape,axis,other,count,expected",
    [
        ([16, 32], 0, [2, 8, 32], 2, 0),  # rows of [B·S, H] in halves: halves of B
        ([16, 32], 0, [2, 8, 32], 4, None),  # quarters: half a batch entry each, no block of B
        ([2, 8, 32], 1, [16, 32], 2, None),  # halves of S are not blocks of B·S
        ([2, 8, 32], 1, [2, 8, 4, 8], 2, 1),  # splitting the last dim keeps S
        ([1, 8, 32], 1, [8, 32], 4, 0),  # batch 1: S is the leading dim
        ([8, 32], 0, [1, 8, 32], 4, 1),
        ([4, 6], 1, [24], 2, None),
    ],
)
def test_reshape_keeps_pieces_blocks_only_where_it_can(shape, axis, other, count, expected):
    assert reshape_axis(shape, axis, other, count) == expected


def _rows(node) -> int:
    return fake(node).shape[0]


def mlp_with_row_local_tail(x, w1, b, g, w_rep):
    """AG → mm → bias, silu, RMSNorm over the last dim, a replicated matmul; then a row-mixing
    column sum (not fusible)."""
    h = funcol.all_gather_tensor(x, 0, torch.distributed.group.WORLD)
    y = F.silu(h @ w1 + b)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    z = y @ w_rep
    return z, z.sum(0)


@pytest.fixture(scope="module")
def tail_graphs(world):
    inputs = [torch.randn(6, 16), torch.randn(16, 32), torch.randn(32), torch.randn(32), torch.randn(32, 8)]
    return post_grad_graphs(mlp_with_row_local_tail, *(t.requires_grad_() for t in inputs))


def test_row_local_ops_after_flash_ag_run_per_piece(tail_graphs):
    gathered_rows = 6 * WORLD
    for r in range(WORLD):
        graph, (site,), _ = rewrite_as(tail_graphs["forward"], r, "forward", pin_order=False)
        assert site.decision == "rewrite", site.reason
        assert any(note.startswith("fused into the steps") for note in site.notes), site.notes
        # Every matmul — the consumer and the replicated one — now runs on one piece of rows.
        mms = [n for n in graph.nodes if n.target in MATMULS]
        assert len(mms) == 2 * WORLD and all(_rows(n) == gathered_rows // WORLD for n in mms)
        # The norm's reduction runs per piece too, and the compute each step pins between its
        # start and wait covers the fused ops (so they overlap that step's transfer).
        means = [n for n in graph.nodes if n.target is torch.ops.aten.mean.dim]
        assert len(means) == WORLD and all(_rows(n) == gathered_rows // WORLD for n in means)
        for step in site.steps:
            assert any(unpinned(n)[0] in MATMULS for n in step.compute[1:]), step.compute
        # The column sum mixes rows: it reads z put back together, once.
        (column_sum,) = [n for n in graph.nodes if n.target is torch.ops.aten.sum.dim_IntList]
        assert column_sum.args[0].target is torch.ops.aten.cat.default


def test_fusion_off_cuts_only_the_matmuls(tail_graphs):
    graph, (site,), _ = rewrite_as(tail_graphs["forward"], 1, "forward", fusion=False, pin_order=False)
    assert site.decision == "rewrite" and not site.fused
    mms = [n for n in graph.nodes if n.target in MATMULS]
    assert sorted(_rows(n) for n in mms) == [6] * WORLD + [6 * WORLD]  # the replicated one whole


def test_flash_rs_computes_the_norm_and_activation_gradients_per_piece(tail_graphs):
    """Backward: dX = dY1 @ W1^T → reduce-scatter, where dY1 comes from the replicated
    matmul's, the norm's (a row sum, broadcast back by expand) and silu's gradients: all
    row-local, so each step computes its own rows of dY1."""
    graph, (site,), _ = rewrite_as(tail_graphs["backward"], 2, "backward", pin_order=False)
    assert site.pattern == "matmul_reduce_scatter" and site.decision == "rewrite", site.reason
    fused = {n.target for n in site.fused}
    assert {torch.ops.aten.mm.default, torch.ops.aten.sum.dim_IntList, torch.ops.aten.expand.default} <= fused, site.notes
    rows = [_rows(n) for n in graph.nodes if n.target is MM and fake(n.args[1]).shape == (8, 32)]  # dZ @ W_rep^T
    assert rows == [6] * WORLD  # gradient of the replicated matmul: one piece of rows at a time


HEADS, HEAD_DIM, SEQ_SHARD = 2, 4, 4


def attention(x, w_qkv, w_out):
    """Sequence-parallel causal attention: gather [B, S/N, H] on S, q/k/v, SDPA, output
    projection, reduce-scatter on S."""
    group = torch.distributed.group.WORLD
    h = funcol.all_gather_tensor(x, 1, group)
    b, s, _ = h.shape
    q, k, v = ((h @ w).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for w in w_qkv.unbind(0))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return funcol.reduce_scatter_tensor(out.transpose(1, 2).reshape(b, s, -1) @ w_out, "sum", 1, group)


@pytest.fixture(scope="module")
def attention_graphs(world):
    inputs = [torch.randn(2, SEQ_SHARD, 16), torch.randn(3, 16, HEADS * HEAD_DIM), torch.randn(HEADS * HEAD_DIM, 16)]
    return post_grad_graphs(attention, *(t.requires_grad_() for t in inputs))


@pytest.mark.parametrize("schedule,m", [("ring", 1), ("bidirectional", 1), ("slicing", 2)])
def test_query_split_attention_before_flash_rs(attention_graphs, schedule, m):
    seq = SEQ_SHARD * WORLD
    count = WORLD * (2 * m if schedule == "bidirectional" else m)
    length = seq // count
    for r in range(WORLD):
        graph, sites, _ = rewrite_as(attention_graphs["forward"], r, "forward", schedule=schedule, chunks_per_rank=m)
        ag, rs = sites
        assert (ag.decision, rs.decision) == ("rewrite", "rewrite"), (ag.reason, rs.reason)
        assert not ag.fused  # only views between the q/k/v matmuls and attention: nothing to gain
        assert any("query-split attention" in note for note in rs.notes), rs.notes
        attentions = [n for n in graph.nodes if n.target is CPU_FLASH]
        # per piece of query rows: its diagonal block causal, the keys before it in full, no mask
        assert attention_calls(attentions) == query_split_calls(length, range(count))


def test_no_fusion_where_the_ring_would_feed_itself(world):
    """y = relu(x) @ (relu(x).t() @ v): the matmul's weight needs all of relu(x), so relu(x)
    cannot be computed piece by piece inside the ring that needs the weight first."""

    def f(x, v):
        p = torch.relu(x)
        return funcol.reduce_scatter_tensor(p @ (p.t() @ v), "sum", 0, torch.distributed.group.WORLD)

    graphs = post_grad_graphs(f, torch.randn(16, 8), torch.randn(16, 8), backward=False)
    kind, graph = next(iter(graphs.items()))
    _, (site,), _ = rewrite_as(graph, 0, kind)
    assert site.decision == "rewrite" and not site.fused, (site.reason, site.notes)
    assert any(note.startswith("not fused: relu") for note in site.notes), site.notes
