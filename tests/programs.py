"""Toy programs traced in the tests and the rank-side functions that check them against eager.

Every program is written with the functional collectives over the default group, the way a
hand-written tensor / sequence-parallel layer is. Inputs are drawn from one seed on every rank
(so the full weights agree) and each rank keeps its own shard.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import commfuse_compile

# Tolerances for "compiled with commfuse" vs "the same program eagerly". The ring sums partial
# products in a different order than gloo's reduce-scatter, so results are compared with a
# tolerance, never bitwise. fp32: element-wise, |a - e| <= atol + rtol·|e|. bf16 keeps 8 bits
# of mantissa and the ring rounds once per step, so an element near zero in a tensor of large
# values can be off by a rounding of those values: |a - e| <= atol + rtol·max|e| per tensor
# (a wrong chunk or a lost partial sum is off by O(max|e|), far outside either).
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The toy programs are far too small for ``schedule="auto"`` to decompose on CPU: the tests
# name the schedule they check (auto has its own tests).
RING = {"schedule": "ring"}


def _group():
    return dist.group.WORLD


def canonical(x, w1, w2):
    """relu(AG(x) @ W1) @ W2 → RS, on 2-D activations [rows, H]."""
    h = funcol.all_gather_tensor(x, 0, _group())
    return funcol.reduce_scatter_tensor(torch.relu(h @ w1) @ w2, "sum", 0, _group())


def leading_dims(x, w1, w2):
    """The same on [B, S, H] activations: reshape → mm → reshape around both collectives."""
    h = funcol.all_gather_tensor(x, 0, _group())
    y = torch.relu(torch.matmul(h, w1)) @ w2
    return funcol.reduce_scatter_tensor(y, "sum", 0, _group())


def reused(x, w1, w2):
    """The gathered tensor is also read by another op (and so saved for backward)."""
    h = funcol.all_gather_tensor(x, 0, _group())
    out = funcol.reduce_scatter_tensor(torch.relu(h @ w1) @ w2, "sum", 0, _group())
    return out, torch.tanh(h).mean(dim=-1)


def sequence_parallel(x, w1, w2):
    """Gather and scatter on the sequence dim (split/cat forms); one gather feeds two matmuls
    and the scattered tensor is a sum of two matmuls (so is its gradient's)."""
    h = funcol.all_gather_tensor(x, 1, _group())  # [B, S/N, H] -> [B, S, H]
    a, b = h @ w1, h @ w2.t()
    y = torch.relu(a) @ w2 + b @ w2
    return funcol.reduce_scatter_tensor(y, "sum", 1, _group())


def weight_gather(x, w1, w2):
    """FSDP-style: the weight is gathered. It feeds one matmul through a transpose (chunks of
    output columns) and one as the right operand (chunks of the contraction dim)."""
    w = funcol.all_gather_tensor(w2, 0, _group())  # [N·F, H]
    u = torch.cat([torch.relu(x @ w1)] * dist.get_world_size(), dim=1)  # [rows, N·F], not from w
    return x @ w.t(), u @ w


def batch1_view(x, w1, w2):
    """DTensor's batch-1 sequence gather: ``all_gather`` of [1, S/N, H] shards, then views
    [N, S/N, H] → [S, H] (no split/cat); the gathered dim 0 has only N entries, so pieces finer
    than a rank's chunk are blocks of rows."""
    h = funcol.all_gather_tensor(x.unsqueeze(0), 0, _group()).view(-1, x.shape[-1])
    return funcol.reduce_scatter_tensor(torch.relu(h @ w1) @ w2, "sum", 0, _group())


def row_local(x, w1, w2):
    """Row-local ops between the collectives, fused into the ring steps: a bias, silu, a norm
    over the last dim and a matmul with a replicated weight after the gather (their gradients
    around the backward collectives)."""
    h = funcol.all_gather_tensor(x, 0, _group())
    y = F.silu(h @ w1 + 0.25)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    width = y.shape[-1]
    mix = torch.linspace(-1.0, 1.0, width * width, dtype=y.dtype).view(width, width) / width**0.5  # replicated
    return funcol.reduce_scatter_tensor((y @ mix) @ w2, "sum", 0, _group())


def attention(x, w1, w2):
    """Sequence-parallel causal self-attention, heads split across ranks: gather on the
    sequence dim, q / k / v projections, SDPA, output projection, reduce-scatter on the
    sequence dim. The reduce-scatter follows the output projection: query-split attention."""
    h = funcol.all_gather_tensor(x, 1, _group())  # [B, S, H]
    b, s, _ = h.shape
    q, k, v = ((h @ w).view(b, s, 4, -1).transpose(1, 2) for w in (w1, w1.flip(0), 0.5 * w1))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return funcol.reduce_scatter_tensor(out.transpose(1, 2).reshape(b, s, -1) @ w2, "sum", 1, _group())


def spmd_layout(x, w1, w2):
    """torchtitan's ``spmd_types`` forms: ``movedim(1, 0).contiguous()`` → gather on dim 0 →
    ``movedim(0, 1)``, and the mirror around the reduce-scatter (permute + clone in aten)."""
    h = funcol.all_gather_tensor(x.movedim(1, 0).contiguous(), 0, _group()).movedim(0, 1)  # [B, S, H]
    y = torch.relu(h @ w1) @ w2
    return funcol.reduce_scatter_tensor(y.movedim(1, 0).contiguous(), "sum", 0, _group()).movedim(0, 1)


def averaged(x, w1, w2):
    """A reduce-scatter with ``"avg"`` (forward only: funcol has no backward for it)."""
    h = funcol.all_gather_tensor(x, 0, _group())
    return funcol.reduce_scatter_tensor(torch.relu(h @ w1) @ w2, "avg", 0, _group())


def last_dim(x, w1, w2):
    """A gather along the left operand's last (contraction) dim, ``AG(x, dim=-1) @ B`` with B
    replicated: each step multiplies a column block of x with a row block of B. Its backward is
    a reduce-scatter along the last dim (output columns)."""
    h = funcol.all_gather_tensor(x, 1, _group())  # [rows, K]
    k = h.shape[-1]
    # replicated; made in fp32 and rounded once (Inductor's bf16 linspace rounds otherwise than eager's)
    mix = (torch.linspace(-1.0, 1.0, k * HIDDEN).view(k, HIDDEN) / k**0.5).to(h.dtype)
    # (silu, not relu: bf16 partial products round otherwise than one matmul, and a relu mask
    # flipped by that rounding would change a gradient by a whole value)
    y = F.silu((h @ mix) @ w1) @ w2
    return funcol.reduce_scatter_tensor(y, "sum", 0, _group())


def _save_reduce_scatter(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    saved = op is torch.ops._c10d_functional.reduce_scatter_tensor.default
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _squared_mlp(x, w1, w2):
    h = funcol.all_gather_tensor(x, 0, _group())
    out = funcol.reduce_scatter_tensor(torch.relu(h @ w1) @ w2, "sum", 0, _group())
    return out * out  # (its backward reads out)


def saved_scatter(x, w1, w2):
    """Per-op selective activation checkpointing that saves the reduce-scatter: the forward
    graph's collective is read by its wait and by the graph output (saved for backward, which
    waits on it again); everything else is recomputed in backward."""
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context = functools.partial(create_selective_checkpoint_contexts, _save_reduce_scatter)
    return checkpoint(_squared_mlp, x, w1, w2, use_reentrant=False, context_fn=context)


class _SumForward(torch.autograd.Function):
    """Megatron's ``g``: the all-reduce after a row-parallel matmul; identity in backward."""

    @staticmethod
    def forward(ctx, y):
        return funcol.all_reduce(y, "sum", _group())

    @staticmethod
    def backward(ctx, grad):
        return grad


class _SumBackward(torch.autograd.Function):
    """Megatron's ``f``: identity before a column-parallel matmul; its gradient all-reduced."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", _group())


def plain_tp(x, w1, w2):
    """Plain tensor parallelism (Megatron without sequence parallelism, Hugging Face's TP
    plans): ``x`` replicated, a column-parallel W1 and a row-parallel W2 with an all-reduce
    after it, the residual add and an RMSNorm before the next block's matmul; backward
    all-reduces the gradient of each block's input."""

    def block(h, a, b):  # (silu, not relu: see last_dim)
        return _SumForward.apply(F.silu(_SumBackward.apply(h) @ a) @ b)

    h = x + block(x, w1, w2)
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return h + block(n, w1.flip(0), w2)


def expert_parallel(x, w1, w2):
    """An expert-parallel MoE layer, one expert per rank and a fixed capacity: this rank's tokens
    [N·C, H], grouped by expert and scaled by their gate (row-local), are dispatched (block j to
    rank j), this rank's expert FFN (W1, W2: its own) runs on what arrived, and the outputs are
    combined back (block j to rank j) and scaled again."""
    gate = torch.sigmoid(x.mean(-1, keepdim=True))
    routed = funcol.all_to_all_single_autograd(x * gate, None, None, _group())
    y = F.silu(routed @ w1) @ w2
    back = funcol.all_to_all_single_autograd(y, None, None, _group())
    return back * gate


def ulysses(x, w1, w2, masked=False):
    """Ulysses sequence parallelism, two heads per rank: this rank's rows of the sequence
    [S/N, H], replicated q / k / v weights, an all-to-all each from sequence- to head-sharded
    (head group j's columns to rank j), laid out [1, heads, S, d] for causal attention over the
    whole sequence, transposed back and squeezed to rows of S, an all-to-all back (head group j's
    output for this rank's rows from rank j) and the (per-rank) projections W1, W2. ``masked``:
    the causal mask given as a bool mask instead."""
    n, (rows, hidden) = dist.get_world_size(), x.shape
    heads, d = ULYSSES_HEADS_PER_RANK, hidden // (n * ULYSSES_HEADS_PER_RANK)
    mix = torch.linspace(-1.0, 1.0, hidden * hidden, dtype=x.dtype).view(hidden, hidden) / hidden**0.5  # replicated

    def to_heads(w):  # [S/N, H] -> [n groups, S/N, heads·d] -> this rank's group over the sequence [1, heads, S, d]
        groups = (x @ w).view(rows, n, heads * d).permute(1, 0, 2).contiguous()
        got = funcol.all_to_all_single_autograd(groups.view(-1, heads * d), None, None, _group())
        return got.view(1, n * rows, heads, d).transpose(1, 2)

    q, k, v = to_heads(mix), to_heads(mix.flip(0)), to_heads(0.5 * mix)
    causal = {"attn_mask": torch.ones(n * rows, n * rows, dtype=torch.bool).tril()} if masked else {"is_causal": True}
    o = F.scaled_dot_product_attention(q, k, v, **causal).transpose(1, 2).squeeze(0)  # [S, heads, d]
    back = funcol.all_to_all_single_autograd(o.reshape(n * rows, heads * d), None, None, _group())
    return F.silu(back.view(n, rows, heads * d).permute(1, 0, 2).reshape(rows, hidden) @ w1) @ w2


ULYSSES_HEADS_PER_RANK = 2


FP8 = torch.float8_e4m3fn


def _fp8_columns(w):
    """``w`` in fp8, column-major (``_scaled_mm``'s right operand)."""
    return w.to(FP8).t().contiguous().t()


def _row_scale(rows: int) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, rows).view(rows, 1)  # replicated: the same on every rank


def _scaled(x, w1, w2, rowwise: bool):
    """fp8 as PyTorch's async-TP tests write it: the shard's fp8 bytes gathered as uint8 and
    viewed back, ``_scaled_mm`` on the gathered rows; relu, fp8 again, and a ``_scaled_mm``
    whose bf16 product is reduce-scattered."""
    a = funcol.all_gather_tensor(x.to(FP8).view(torch.uint8), 0, _group()).view(FP8)  # [N·rows, H]
    rows = a.shape[0]
    if rowwise:
        scales = [_row_scale(rows), torch.full((1, w1.shape[1]), 0.5), _row_scale(rows).flip(0), torch.full((1, w2.shape[1]), 2.0)]
    else:
        scales = [torch.tensor(0.75), torch.tensor(0.5), torch.tensor(1.25), torch.tensor(2.0)]
    h = torch._scaled_mm(a, _fp8_columns(w1), scales[0], scales[1], out_dtype=torch.bfloat16)
    y = torch._scaled_mm(torch.relu(h).to(FP8), _fp8_columns(w2), scales[2], scales[3], out_dtype=torch.bfloat16)
    return funcol.reduce_scatter_tensor(y, "sum", 0, _group())


def scaled_tensorwise(x, w1, w2):
    """fp8 ``_scaled_mm`` with tensorwise scales around both collectives (inference)."""
    return _scaled(x, w1, w2, rowwise=False)


def scaled_rowwise(x, w1, w2):
    """fp8 ``_scaled_mm`` with rowwise scales ([M, 1] and [1, N]) around both collectives."""
    return _scaled(x, w1, w2, rowwise=True)


def scaled_sequence(x, w1, w2):
    """fp8 gathered along the sequence (dim 1 of [B, S/N, H]) in the form PyTorch's async TP
    matches: the bytes gathered as uint8 on dim 0, each rank's chunk viewed as fp8 between the
    split and the cat; a tensorwise ``_scaled_mm`` on the gathered rows, one on the scattered."""
    n = dist.get_world_size()
    gathered = funcol.all_gather_tensor(x.to(FP8).view(torch.uint8), 0, _group())  # [N·B, S/N, H]
    a = torch.cat([chunk.view(FP8) for chunk in gathered.chunk(n, 0)], 1)  # [B, S, H]
    scales = [torch.full((), s) for s in (0.75, 0.5, 1.25, 2.0)]
    h = torch._scaled_mm(a.flatten(0, 1), _fp8_columns(w1), scales[0], scales[1], out_dtype=torch.bfloat16)
    y = torch._scaled_mm(torch.relu(h).to(FP8), _fp8_columns(w2), scales[2], scales[3], out_dtype=torch.bfloat16)
    return funcol.reduce_scatter_tensor(y.view(a.shape[0], a.shape[1], -1), "sum", 1, _group())


PROGRAMS: dict[str, tuple[Callable, tuple[int, ...]]] = {
    # name: (program, per-rank activation shape)
    "canonical": (canonical, (12, 16)),
    "leading_dims": (leading_dims, (2, 3, 16)),
    "reused": (reused, (6, 16)),
    "sequence_parallel": (sequence_parallel, (2, 6, 16)),  # sharded on dim 1
    "weight_gather": (weight_gather, (6, 16)),
    "row_local": (row_local, (6, 16)),
    "batch1_view": (batch1_view, (8, 16)),
    "attention": (attention, (2, 6, 16)),  # sharded on dim 1
    "spmd_layout": (spmd_layout, (2, 6, 16)),  # sharded on dim 1
    "averaged": (averaged, (12, 16)),
    "last_dim": (last_dim, (24, 4)),  # sharded on dim 1
    "saved_scatter": (saved_scatter, (12, 16)),
    "scaled_tensorwise": (scaled_tensorwise, (16, 16)),
    "scaled_rowwise": (scaled_rowwise, (16, 16)),
    "scaled_sequence": (scaled_sequence, (2, 8, 16)),  # sharded on dim 1
    "plain_tp": (plain_tp, (2, 16, 16)),  # replicated
    "expert_parallel": (expert_parallel, (0, 16)),  # [N·C, H]: C = 4 tokens per expert (below)
    "ulysses": (ulysses, (8, 16)),
}
SHARD_DIM = {"sequence_parallel": 1, "attention": 1, "spmd_layout": 1, "last_dim": 1, "scaled_sequence": 1}
REPLICATED = {"plain_tp"}  # the activation is the same on every rank
FORWARD_ONLY = {"averaged", "scaled_tensorwise", "scaled_rowwise", "scaled_sequence"}  # (no backward: funcol's "avg", CPU _scaled_mm)
HIDDEN, FFN = 16, 32


def make_inputs(program: str, rank: int, world: int, dtype: torch.dtype, batch: int | None = None) -> list[torch.Tensor]:
    """This rank's activation shard, column shard of W1 and row shard of W2 (leaf tensors);
    ``batch`` replaces the activation's dim 0 (a [B, S/N, H] program's batch)."""
    _, shard_shape = PROGRAMS[program]
    if program == "expert_parallel":  # capacity 4 per expert
        shard_shape = (4 * world, *shard_shape[1:])
    if batch is not None:
        shard_shape = (batch, *shard_shape[1:])
    dim = SHARD_DIM.get(program, 0)
    replicated = program in REPLICATED
    full_shape = [s * world if i == dim and not replicated else s for i, s in enumerate(shard_shape)]
    gen = torch.Generator().manual_seed(1234 + (batch or 0))
    x = torch.randn(full_shape, generator=gen)
    x = x if replicated else x.chunk(world, dim)[rank]
    w1 = torch.randn(HIDDEN, FFN * world, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(FFN * world, HIDDEN, generator=gen) / FFN**0.5
    ffn = FFN
    shards = [x, w1[:, rank * ffn : (rank + 1) * ffn], w2[rank * ffn : (rank + 1) * ffn]]
    return [s.to(dtype).contiguous().requires_grad_() for s in shards]


def forward_backward(fn: Callable, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs and input grads of ``fn`` for a fixed random upstream gradient."""
    for t in inputs:
        t.grad = None
    outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    gen = torch.Generator().manual_seed(99 + dist.get_rank())
    loss = sum((o * torch.randn(o.shape, generator=gen).to(o.dtype)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs] + [t.grad for t in inputs]


def forward_only(fn: Callable, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs of ``fn`` without autograd (an inference graph)."""
    with torch.no_grad():
        outs = fn(*inputs)
    return list(outs) if isinstance(outs, tuple) else [outs]


def compare(actual: list[torch.Tensor], expected: list[torch.Tensor], dtype: torch.dtype) -> list[dict]:
    grads = ["grad_x", "grad_w1", "grad_w2"] if len(actual) > 3 else []
    names = [f"out{i}" for i in range(len(actual) - len(grads))] + grads
    tol = TOLERANCES[dtype]
    rows = []
    for name, a, e in zip(names, actual, expected):
        a, e = a.float(), e.float()
        diff = (a - e).abs().max().item()
        if dtype == torch.float32:
            close = torch.allclose(a, e, **tol)
        else:
            close = diff <= tol["atol"] + tol["rtol"] * e.abs().max().item()
        rows.append(dict(name=name, max_abs_diff=diff, max_abs=e.abs().max().item(), close=close, shape=list(a.shape)))
    return rows


def site_summary(report: commfuse_compile.CompileReport) -> list[tuple[str, str, str, str]]:
    return [(s.graph, s.pattern, s.action, s.reason) for s in report.sites]


# ---- functions run on every rank (module level so the rank pool can import them) ----------


def check_against_eager(program: str, dtype_name: str, options: dict | None = None, dynamic: bool | None = None) -> dict:
    """Compile ``program`` with commfuse; compare outputs and grads with eager on this rank."""
    torch._dynamo.reset()
    dtype = DTYPES[dtype_name]
    fn, _ = PROGRAMS[program]
    inputs = make_inputs(program, dist.get_rank(), dist.get_world_size(), dtype)
    run = forward_only if program in FORWARD_ONLY else forward_backward
    expected = run(fn, inputs)
    compiled = torch.compile(fn, backend="commfuse", options={**RING, **(options or {})}, dynamic=dynamic)
    actual = run(compiled, inputs)
    again = run(compiled, inputs)  # a second call reuses the compiled ring
    return dict(
        diffs=compare(actual, expected, dtype),
        repeat_diffs=compare(again, expected, dtype),
        sites=site_summary(commfuse_compile.last_report()),
        records=[
            dict(schedule=s.schedule, chunks_per_rank=s.chunks_per_rank, fused=s.fused) for s in commfuse_compile.last_report().sites
        ],
        notes=[note for s in commfuse_compile.last_report().sites for note in s.notes],
    )


def check_batch_sizes(program: str, dtype_name: str, options: dict, batches: list[int]) -> list[dict]:
    """Compile ``program`` once with ``torch.compile``'s default ``dynamic=None`` and call it on
    activations of each batch size in turn (the second size recompiles with the batch
    symbolic; later ones reuse that graph): per call, the comparison with eager, and the sites
    of the graphs compiled for it (none when it reused a compiled graph)."""
    torch._dynamo.reset()
    dtype = DTYPES[dtype_name]
    fn, _ = PROGRAMS[program]
    compiled = torch.compile(fn, backend="commfuse", options={**RING, **options})
    calls = []
    for batch in batches:
        inputs = make_inputs(program, dist.get_rank(), dist.get_world_size(), dtype, batch)
        expected = forward_backward(fn, inputs)
        seen = len(commfuse_compile.reports())
        actual = forward_backward(compiled, inputs)
        new = commfuse_compile.reports()[seen:]
        sites = [(s.graph, s.pattern, s.action, s.reason, s.fused) for r in new for s in r.sites]
        symbolic = [any(not isinstance(size, int) for shape in s.shapes.values() for size in shape) for r in new for s in r.sites]
        calls.append(dict(batch=batch, diffs=compare(actual, expected, dtype), sites=sites, symbolic=symbolic))
    return calls


def generated_code(program: str, options: dict | None = None) -> list[str]:
    """Inductor's generated Python for the forward and backward graphs of ``program``."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn, _ = PROGRAMS[program]
    inputs = make_inputs(program, dist.get_rank(), dist.get_world_size(), torch.float32)
    compiled = torch.compile(fn, backend="commfuse", options={**RING, **(options or {})})
    _, code = run_and_get_code(forward_backward, compiled, inputs)
    return code


_START = re.compile(r"^\s*(buf\d+) = torch\.ops\.commfuse\.ring_exchange\.default\(")
_ALIAS = re.compile(r"^\s*(buf\d+) = (buf\d+)\s*$")
_WAIT = re.compile(r"torch\.ops\.commfuse\.wait_exchange\.default\((buf\d+), ")
_MM = re.compile(r"extern_kernels\.(mm|addmm)\(")


_SENT = re.compile(r"ring_exchange\.default\((?:reinterpret_tensor\()?(\w+)")
_HELD = re.compile(r"wait_exchange\.default\((buf\d+), (?:reinterpret_tensor\()?(\w+)")
_REUSE = re.compile(r"del (buf\d+)  # reuse")


def unheld_sends(code: str) -> list[str]:
    """Ring transfers in ``code`` whose sent buffer is not the one their wait holds, or whose
    memory Inductor gives to another buffer before the wait (either lets a result overwrite a
    block still on the wire). Buffers are followed through ``bufB = bufA`` aliases."""
    origin: dict[str, str] = {}
    sending: dict[str, tuple[int, str]] = {}  # received buffer -> (line of its start, sent buffer)
    problems = []

    def name(buf: str) -> str:
        return origin.get(buf, buf)

    for i, line in enumerate(code.splitlines()):
        if m := _START.match(line):
            sending[m.group(1)] = (i, name(_SENT.search(line).group(1)))
        elif m := _ALIAS.match(line):
            origin[m.group(1)] = name(m.group(2))
        elif m := _HELD.search(line):
            start, sent = sending.pop(name(m.group(1)), (None, None))
            if sent is not None and name(m.group(2)) != sent:
                problems.append(f"line {i}: the wait holds {name(m.group(2))}, the start (line {start}) sent {sent}")
        if m := _REUSE.search(line):
            problems += [f"line {i}: {m.group(1)} reused while it is sent" for _, sent in sending.values() if sent == name(m.group(1))]
    return problems


def ring_events(code: str) -> list[tuple[int, int, int]]:
    """For every ring transfer in ``code``: (line of its start, matmuls between start and wait,
    line of its wait). Buffers are followed through Inductor's ``bufB = bufA`` aliases."""
    lines = code.splitlines()
    origin: dict[str, str] = {}
    started: dict[str, int] = {}
    events = []
    for i, line in enumerate(lines):
        if m := _START.match(line):
            started[m.group(1)] = i
        elif m := _ALIAS.match(line):
            origin[m.group(1)] = origin.get(m.group(2), m.group(2))
        elif m := _WAIT.search(line):
            buf = origin.get(m.group(1), m.group(1))
            if buf in started:
                start = started.pop(buf)
                mms = sum(1 for l in lines[start:i] if _MM.search(l))
                events.append((start, mms, i))
    assert not started, f"ring transfers never waited on: {sorted(started)}"
    return events
