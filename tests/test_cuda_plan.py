"""Planning a GPU compile without a GPU: ``explain(..., device="cuda")`` builds the forward and
backward graphs a CUDA compile would (fake tensors, nothing allocated) and runs the pass on them;
query-split attention on the CUDA attention ops (flash, memory-efficient, cuDNN)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from graphs import attention_calls, query_split_calls
from torch.nn.attention import SDPBackend, sdpa_kernel

from commfuse_compile import explain, fake_world
from commfuse_compile.passes.attention import CUDNN, EFFICIENT, FLASH, arguments, is_attention, mask_name

aten = torch.ops.aten

WORLD, HEADS, HEAD_DIM, SHARD = 4, 2, 16, 8
SEQ = WORLD * SHARD
KERNELS = {"flash": (SDPBackend.FLASH_ATTENTION, FLASH), "efficient": (SDPBackend.EFFICIENT_ATTENTION, EFFICIENT), "cudnn": (SDPBackend.CUDNN_ATTENTION, CUDNN)}


def attention(x, w_qkv, w_out, mask=None, causal=True):
    """Sequence-parallel attention: gather [B, S/N, D] on S, q/k/v, attention, output
    projection, reduce-scatter on S (whose Flash-RS computes attention one query piece a step)."""
    group = dist.group.WORLD
    h = funcol.all_gather_tensor(x, 1, group)
    b, s, _ = h.shape
    q, k, v = ((h @ w).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for w in w_qkv.unbind(0))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return funcol.reduce_scatter_tensor(out.transpose(1, 2).reshape(b, s, -1) @ w_out, "sum", 1, group)


def meta_inputs(dtype=torch.bfloat16):
    shapes = [(1, SHARD, 64), (3, 64, HEADS * HEAD_DIM), (HEADS * HEAD_DIM, 64)]
    return [torch.empty(s, dtype=dtype, device="meta", requires_grad=True) for s in shapes]


def plan(kernel: str, *extra, causal=True, m=1, schedule="ring"):
    with fake_world(WORLD), sdpa_kernel(KERNELS[kernel][0]):
        return explain(
            lambda x, w_qkv, w_out, *mask: attention(x, w_qkv, w_out, *mask, causal=causal),
            *meta_inputs(),
            *extra,
            options={"schedule": schedule, "chunks_per_rank": m},
            device="cuda",
        )


def attention_nodes(report, kind="forward"):
    graph = report.graphs[kind].graph
    return [n for n in graph.nodes if n.op == "call_function" and "attention" in str(n.target)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_query_split_on_each_cuda_attention_op(kernel, causal):
    report = plan(kernel, causal=causal)
    op = KERNELS[kernel][1]
    scatter = next(m for m in report.matches if m.graph == "forward" and m.kind == "matmul_reduce_scatter")
    assert scatter.rewritten and any("query-split attention" in n for n in scatter.notes), scatter.notes
    calls = attention_nodes(report)
    assert {n.target for n in calls} == {op}
    for node in calls:  # all on CUDA
        assert node.meta["val"][0].device == torch.device("cuda", 0)
    length = SHARD  # ring, m=1: one piece of S/N query rows per step
    if not causal:
        expected = [(length, 0, SEQ, False)] * WORLD
    elif op is FLASH:  # one call on keys [:e], causal aligned to the lower right
        expected = [(length, 0, (q + 1) * length, True) for q in range(WORLD)]
    else:  # the diagonal block causal, and the keys before it in full
        expected = query_split_calls(length, range(WORLD))
    assert attention_calls(calls) == sorted(expected)


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("schedule,m", [("ring", 2), ("bidirectional", 1), ("slicing", 2)])
def test_query_split_for_every_schedule(kernel, schedule, m):
    report = plan(kernel, schedule=schedule, m=m)
    count = WORLD * (2 * m if schedule == "bidirectional" else m)
    length = SEQ // count
    if kernel == "flash":
        expected = [(length, 0, (q + 1) * length, True) for q in range(count)]
    else:
        expected = query_split_calls(length, range(count))
    assert attention_calls(attention_nodes(report)) == sorted(expected)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_backward_op_reads_the_whole_outputs_assembled_from_the_pieces(kernel):
    """The backward attention op is the whole op's: its out and logsumexp are the pieces'
    put back together in the forward (shapes and devices as the op's own), its RNG state
    a piece's (no dropout)."""
    report = plan(kernel)
    op = KERNELS[kernel][1]
    (backward,) = [n for n in attention_nodes(report, "backward")]
    assert str(backward.target).startswith(str(op).replace(".default", "_backward"))
    named = arguments(backward.target, backward.args, backward.kwargs)
    out, lse = named["out"], named["logsumexp"]
    assert tuple(out.meta["val"].shape) == (1, HEADS, SEQ, HEAD_DIM)
    rows = {FLASH: (1, HEADS, SEQ), EFFICIENT: (1, HEADS, -(-SEQ // 32) * 32), CUDNN: (1, HEADS, SEQ, 1)}[op]
    assert tuple(lse.meta["val"].shape) == rows and lse.meta["val"].device.type == "cuda"
    assert named["is_causal"] is True
    forward = report.graphs["forward"].graph
    assert not any(n.target is op and n.meta["val"][0].shape[2] == SEQ for n in forward.nodes), "the whole attention still runs"
    saved = forward.output_node().args[0][1:]
    assembled = [tuple(n.meta["val"].shape) for n in saved if n.target in (aten.cat.default, aten.constant_pad_nd.default)]
    assert tuple(out.meta["val"].shape) in assembled and rows in assembled, assembled
    rng = [n for n in saved if n.target is operator.getitem and is_attention(n.args[0]) and n.args[1] > 1]
    assert len(rng) == 2 and all(n.args[0].meta["val"][0].shape[2] == SHARD for n in rng)  # a piece's call


def test_a_mask_is_cut_with_its_query_rows():
    """Memory-efficient attention with a boolean mask [S, S]: each piece's call reads rows
    [s, e) of the mask (in the query's dtype, as the dispatcher hands it over)."""
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool, device="meta").tril()
    report = plan("efficient", mask, causal=False)
    calls = attention_nodes(report)
    assert len(calls) == WORLD and all(n.target is EFFICIENT for n in calls)
    for node in calls:
        bias = arguments(EFFICIENT, node.args, node.kwargs)[mask_name(EFFICIENT)]
        assert tuple(bias.meta["val"].shape[-2:]) == (SHARD, SEQ) and bias.meta["val"].dtype == torch.bfloat16


def test_a_mask_of_another_dtype_is_not_cut():
    """An fp32 bias on bf16 inputs (cuDNN is reported to compute it wrongly): attention is
    left whole, the ring still runs."""
    with fake_world(WORLD), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        bias = torch.empty(1, HEADS, SEQ, SEQ, dtype=torch.float32, device="meta")

        def with_fp32_bias(x, w_qkv, w_out, bias):
            group = dist.group.WORLD
            h = funcol.all_gather_tensor(x, 1, group)
            b, s, _ = h.shape
            q, k, v = ((h @ w).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for w in w_qkv.unbind(0))
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, False, False)[0]
            return funcol.reduce_scatter_tensor(out.transpose(1, 2).reshape(b, s, -1) @ w_out, "sum", 1, group)

        report = explain(with_fp32_bias, *meta_inputs(), bias, options={"schedule": "ring"}, device="cuda")
    scatter = next(m for m in report.matches if m.graph == "forward" and m.kind == "matmul_reduce_scatter")
    assert scatter.rewritten and not any("query-split" in n for n in scatter.notes), scatter.notes
    assert any("torch.float32 mask on torch.bfloat16 inputs" in n for n in scatter.notes), scatter.notes
    (call,) = attention_nodes(report)
    assert call.meta["val"][0].shape[2] == SEQ


def test_explain_on_cuda_plans_a_llama_block_without_a_gpu():
    """A Llama block with torchtitan's TP + SP plan at world size 8, bf16, built on the meta
    device: forward and backward graphs on cuda:0 with flash attention, the model untouched."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from commfuse_compile.models import Block, tp_plan

    with fake_world(8):
        with torch.device("meta"):
            block = Block(1024, 8, 2816).to(torch.bfloat16)
        block = parallelize_module(block, init_device_mesh("cpu", (8,)), tp_plan())
        x = torch.empty(1, 512, 1024, dtype=torch.bfloat16, device="meta")
        report = explain(block, x, options={"profile": "h100-nvlink"}, device="cuda")
        assert all(p.to_local().is_meta for p in block.parameters())
    assert set(report.graphs) == {"forward", "backward"} and not report.errors
    assert len(report.matches) == 8 and all(m.group_size == 8 for m in report.matches)
    for kind, module in report.graphs.items():
        devices = {n.meta["val"].device for n in module.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
        assert devices == {torch.device("cuda", 0)}, (kind, devices)
    assert {n.target for n in attention_nodes(report)} == {FLASH}
    assert [str(n.target) for n in attention_nodes(report, "backward")] == ["aten._scaled_dot_product_flash_attention_backward.default"]


def test_explain_on_cuda_refuses_what_it_cannot_do():
    with fake_world(2):
        x = torch.empty(4, 8, device="meta")
        with pytest.raises(ValueError, match="codegen"):
            explain(torch.relu, x, device="cuda", codegen=True)
        with pytest.raises(ValueError, match="device must be"):
            explain(torch.relu, x, device="tpu")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate

        on_cuda_mesh = DTensor.from_local(torch.empty(4, 8, device="meta"), init_device_mesh("cuda", (2,)), [Replicate()])
        with pytest.raises(ValueError, match="init_device_mesh\\('cpu'"):
            explain(torch.relu, on_cuda_mesh, device="cuda")
