"""The layers ``step_time.py`` times, each with its sizing, its compute-only and comm-only parts.

A workload says how big to make its layer so that one forward + backward step computes for
about ``compute_ms`` and communicates for about ``comm_ratio`` of that over the shaped link,
builds the layer on one rank, and builds the two parts the ideal is measured from: the same
compute without collectives, and the same collectives without compute.

- ``mlp``: a sequence-parallel MLP, ``all_gather → relu(x @ W1) @ W2 → reduce_scatter``
  (Flash-AG and Flash-RS; every schedule applies).
- ``ulysses``: a Ulysses attention layer, sequence-sharded input, replicated q / k / v / o
  weights, an all-to-all each for q, k and v to head groups, causal attention over the whole
  sequence, an all-to-all back and the output projection (Flash-All-to-All; the ring only).
- ``moe`` / ``moe-skewed``: an expert-parallel MoE layer in torchtitan's form (token counts
  exchanged and read with ``.tolist()``, dispatch, permute to expert-major, grouped experts in
  bf16, permute back, combine; ``moe_ep``), routed evenly or with half of every rank's tokens
  to one peer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Communication of one fw+bw MLP step in units of one all-gather of [S, H]: 2 all-gathers and 2
# reduce-scatters, and gloo's reduce-scatter takes 2x its all-gather (measured here at 400mbit:
# [1280, 512] fp32 over 2 ranks, all-gather 50 ms, reduce-scatter 102 ms; 4 ranks likewise).
GATHER_EQUIVALENTS = 6

# Ulysses: heads per rank (d = H / (N · heads)); the CPU flash attention's FLOP rate relative to
# the matmul rate, for sizing only (measured here, single thread, counting 7·S²·d FLOP per head:
# causal [1, 2, 4096, 64] fp32 forward + backward at 0.76 of the matmul rate, [1, 2, 2048, 32] 0.63).
ULYSSES_HEADS_PER_RANK = 2
ATTENTION_EFFICIENCY = 0.7


def _round_up(value: float, quantum: int) -> int:
    return max(quantum, int(-(-value // quantum)) * quantum)


def _per_rank_flops(flops: float, n: int) -> float:
    """Ranks beyond the core count share cores: each computes at ``flops``·cores/N."""
    return flops * min(1.0, (os.cpu_count() or 1) / n)


def _inductor_step(model: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One fw+bw step of ``model`` on ``x`` compiled by Inductor alone."""
    compiled = torch.compile(model, backend="inductor")

    def step() -> None:
        for t in (x, *model.parameters()):
            t.grad = None
        compiled(x).backward(grad)

    return step


# --- the sequence-parallel MLP ---------------------------------------------------------------


class SequenceParallelMLP(torch.nn.Module):
    """all_gather → relu(h @ w1) @ w2 → reduce_scatter, on this rank's shards (``group`` None:
    the same matmuls on the full input, without collectives)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, group: Any):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        if self.group is None:
            return torch.relu(x @ self.w1) @ self.w2
        h = funcol.all_gather_single(x, 0, self.group)
        return funcol.reduce_scatter_single(torch.relu(h @ self.w1) @ self.w2, "sum", 0, self.group)


class MLPWorkload:
    """The sequence-parallel MLP: x [S/N, H], w1 [H, F/N], w2 [F/N, H] per rank."""

    name = "mlp"
    default_rate = "400mbit"
    variants = ("inductor", "inductor-reorder", "slicing", "ring", "bidirectional", "auto")
    quick = {"S": 64, "H": 32, "F": 64}

    def quick_sizes(self, n: int) -> dict[str, Any]:
        return {"S": self.quick["S"] * n // 2, "H": self.quick["H"], "F": self.quick["F"] * n}

    def plan_sizes(self, n: int, bytes_per_second: float, flops: float, compute_ms: float, comm_ratio: float) -> dict[str, Any]:
        """S, H, F such that fw+bw compute ≈ ``compute_ms`` and communication ≈ ``comm_ratio`` of it.

        Per rank fw + bw is 12·S·H·F/N FLOP (6 matmuls of S·H·F/N multiply-adds). An all-gather
        moves (N−1)·S·H·4 bytes in all over the one shaped loopback that all ranks share; gloo's
        reduce-scatter took twice as long as the all-gather of the same tensor here, so a step's
        2 + 2 collectives count as 6 all-gathers.
        """
        per_rank = _per_rank_flops(flops, n)
        comm_per_sh = GATHER_EQUIVALENTS * (n - 1) * 4 / bytes_per_second  # seconds per unit of S·H
        # comm = ratio · compute  <=>  comm_per_sh = ratio · 12·F / (N · per_rank)
        f = _round_up(comm_per_sh * n * per_rank / (12 * comm_ratio), 16 * n)
        h = 512
        sh = compute_ms / 1e3 * n * per_rank / (12 * f)
        s = _round_up(sh / h, 32 * n)  # per-rank rows divide by every small m and K
        return {
            "S": s,
            "H": h,
            "F": f,
            "matmul_flops_per_rank": per_rank,
            "link_bytes_per_second": bytes_per_second,
            "estimated_compute_ms": 12 * s * h * f / n / per_rank * 1e3,
            "estimated_comm_ms": comm_per_sh * s * h * 1e3,
        }

    def describe(self, sizes: dict[str, Any], n: int) -> str:
        s, h, f = sizes["S"], sizes["H"], sizes["F"]
        return f"S={s} H={h} F={f} (per rank x [{s // n}, {h}], w1 [{h}, {f // n}], w2 [{f // n}, {h}])"

    def build(self, sizes: dict[str, Any], rank: int, n: int, group: Any) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
        """This rank's layer, input shard and output gradient."""
        s, h, f = sizes["S"], sizes["H"], sizes["F"]
        gen = torch.Generator().manual_seed(rank)
        w1 = torch.randn(h, f // n, generator=gen) / h**0.5
        w2 = torch.randn(f // n, h, generator=gen) / (f // n) ** 0.5
        x = torch.randn(s // n, h, generator=gen).requires_grad_()
        return SequenceParallelMLP(w1, w2, group), x, torch.randn(s // n, h, generator=gen)

    def compute_only(self, sizes: dict[str, Any], rank: int, n: int) -> Callable[[], None]:
        """The same matmuls on the full [S, H] input, no collectives, Inductor."""
        model, _, _ = self.build(sizes, rank, n, None)
        gen = torch.Generator().manual_seed(n + rank)
        full = torch.randn(sizes["S"], sizes["H"], generator=gen).requires_grad_()
        return _inductor_step(model, full, torch.randn(sizes["S"], sizes["H"], generator=gen))

    def comm_only(self, sizes: dict[str, Any], n: int, group: Any) -> Callable[[], None]:
        """The collectives of one fw+bw step, eagerly: AG(x), RS(y), RS(dh), AG(dout)."""
        import torch.distributed as dist

        s, h = sizes["S"], sizes["H"]
        x, gathered, full = torch.randn(s // n, h), torch.empty(s, h), torch.randn(s, h)
        shard = torch.empty(s // n, h)

        def step() -> None:
            dist.all_gather_single(gathered, x, group=group)
            dist.reduce_scatter_single(shard, full, group=group)
            dist.reduce_scatter_single(shard, full, group=group)
            dist.all_gather_single(gathered, x, group=group)

        return step


# --- the Ulysses attention layer -------------------------------------------------------------


class UlyssesAttention(torch.nn.Module):
    """Ulysses sequence parallelism on this rank's rows [S/N, H]: q, k, v = x @ W (replicated),
    each all-to-all'd from sequence- to head-sharded (head group j's columns to rank j) and laid
    out [1, heads, S, d]; causal attention of this rank's head group over the whole sequence;
    an all-to-all back (head group j's output for this rank's rows from rank j); ``@ wo``.
    ``group`` None: the all-to-alls become identities (the same shapes and compute)."""

    def __init__(self, weights: list[torch.Tensor], group: Any, world_size: int):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Parameter(w.clone()) for w in weights)
        self.group, self.n = group, world_size

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        return t if self.group is None else funcol.all_to_all_single_autograd(t, None, None, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, (rows, hidden), heads = self.n, x.shape, ULYSSES_HEADS_PER_RANK
        d = hidden // (n * heads)

        def to_heads(w: torch.Tensor) -> torch.Tensor:  # [S/N, H] -> [1, heads, S, d]
            groups = (x @ w).view(rows, n, heads * d).permute(1, 0, 2).contiguous()
            return self._exchange(groups.view(-1, heads * d)).view(1, n * rows, heads, d).transpose(1, 2)

        o = F.scaled_dot_product_attention(to_heads(self.wq), to_heads(self.wk), to_heads(self.wv), is_causal=True)
        back = self._exchange(o.transpose(1, 2).reshape(n * rows, heads * d))
        return back.view(n, rows, heads * d).permute(1, 0, 2).reshape(rows, hidden) @ self.wo


class UlyssesWorkload:
    """The Ulysses attention layer: x [S/N, H] per rank, four replicated [H, H] weights."""

    name = "ulysses"
    default_rate = "1gbit"
    variants = ("inductor", "inductor-reorder", "ring", "auto")  # (all-to-all: the ring schedule, m = 1)
    quick = {"S": 64, "H": 32}

    def quick_sizes(self, n: int) -> dict[str, Any]:
        return {"S": self.quick["S"] * n // 2, "H": self.quick["H"] * n // 2}

    def plan_sizes(self, n: int, bytes_per_second: float, flops: float, compute_ms: float, comm_ratio: float) -> dict[str, Any]:
        """S, H such that fw+bw compute ≈ ``compute_ms`` and communication ≈ ``comm_ratio`` of it.

        Per rank: four projections of [S/N, H] @ [H, H], fw + bw 24·S·H²/N FLOP; causal attention
        of H/N columns over S, about 7·S²·H/N FLOP fw + bw (2 fw, 5 bw with the recompute), at
        ``ATTENTION_EFFICIENCY`` of the matmul rate. Eight all-to-alls (4 fw, 4 bw), each moving
        (N−1)·S·H·4/N bytes in all over the one shaped link. Both targets fix S·H and then H (a
        quadratic; the smaller root, the longer sequence Ulysses is for), rounded up to whole
        heads of a multiple of 32 columns; S then meets the compute target at that H, and the
        communication estimate follows (printed). At 50 MB/s the targets ask for heads of a few
        columns: hence this layer's default link, 1gbit.
        """
        per_rank = _per_rank_flops(flops, n)
        comm_per_sh = 8 * (n - 1) * 4 / n / bytes_per_second
        attention = 7 / ATTENTION_EFFICIENCY
        budget = compute_ms / 1e3 * n * per_rank  # = S·H·(24·H + attention·S)
        sh = comm_ratio * compute_ms / 1e3 / comm_per_sh  # S·H meeting the communication target
        k = budget / sh  # = 24·H + attention·sh/H
        h = _round_up((k - max(k * k - 96 * attention * sh, 0.0) ** 0.5) / 48, 32 * n * ULYSSES_HEADS_PER_RANK)
        # attention·S² + 24·H·S − budget/H = 0
        s = _round_up((-24 * h + ((24 * h) ** 2 + 4 * attention * budget / h) ** 0.5) / (2 * attention), 32 * n)
        return {
            "S": s,
            "H": h,
            "matmul_flops_per_rank": per_rank,
            "link_bytes_per_second": bytes_per_second,
            "estimated_compute_ms": s * h * (24 * h + attention * s) / (n * per_rank) * 1e3,
            "estimated_comm_ms": comm_per_sh * s * h * 1e3,
        }

    def describe(self, sizes: dict[str, Any], n: int) -> str:
        s, h = sizes["S"], sizes["H"]
        return f"S={s} H={h} (per rank x [{s // n}, {h}], {ULYSSES_HEADS_PER_RANK} heads of d={h // (n * ULYSSES_HEADS_PER_RANK)}, 4 weights [{h}, {h}])"

    def build(self, sizes: dict[str, Any], rank: int, n: int, group: Any) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
        """This rank's layer (the weights the same on every rank), input shard and output gradient."""
        s, h = sizes["S"], sizes["H"]
        shared = torch.Generator().manual_seed(0)
        weights = [torch.randn(h, h, generator=shared) / h**0.5 for _ in range(4)]
        gen = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(s // n, h, generator=gen).requires_grad_()
        return UlyssesAttention(weights, group, n), x, torch.randn(s // n, h, generator=gen)

    def compute_only(self, sizes: dict[str, Any], rank: int, n: int) -> Callable[[], None]:
        """The same layer with the all-to-alls as identities (same shapes), Inductor."""
        return _inductor_step(*self.build(sizes, rank, n, None))

    def comm_only(self, sizes: dict[str, Any], n: int, group: Any) -> Callable[[], None]:
        """The eight all-to-alls of one fw+bw step, eagerly, on [S/N, H] tensors."""
        import torch.distributed as dist

        s, h = sizes["S"], sizes["H"]
        sent, got = torch.randn(s // n, h), torch.empty(s // n, h)

        def step() -> None:
            for _ in range(8):
                dist.all_to_all_single(got, sent, group=group)

        return step


# --- the expert-parallel MoE layer ------------------------------------------------------------

# CPU's grouped matmul (bf16 only) against the fp32 matmul rate the sizing measures (single
# thread here: [1024, 512] x [2, 512, 1024] at 196 GFLOP/s, fp32 mm 84).
BF16_GROUPED_SPEEDUP = 2.3
LOCAL_EXPERTS = 2


class ExpertParallelMoE(torch.nn.Module):
    """An MoE layer with expert parallelism as torchtitan's all-to-all token dispatcher runs
    it, on this rank's tokens [T, H] with a fixed routing (``expert``: each token's global
    expert, sorted): count exchange and ``.tolist()``, dispatch, permute to expert-major,
    ``silu(x W1) W2`` per expert as grouped matmuls in bf16, permute back, combine, gate.
    ``group`` None (with ``world_size`` 1 and local experts): the all-to-alls are identities,
    the same compute on this rank's tokens."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, expert: torch.Tensor, group: Any, world_size: int):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
        self.register_buffer("expert", expert)
        self.group, self.n = group, world_size

    def _exchange(self, t: torch.Tensor, out_splits: Any = None, in_splits: Any = None, grad: bool = True) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        if self.group is None:
            return t
        exchange = funcol.all_to_all_single_autograd if grad else funcol.all_to_all_single
        return exchange(t, out_splits, in_splits, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, e = self.n, self.w1.shape[0]
        counts = (self.expert.unsqueeze(1) == torch.arange(n * e)).sum(0).view(n, e)
        per_source = self._exchange(counts, grad=False)
        send, recv = counts.sum(1).tolist(), per_source.sum(1).tolist()
        for size in (*send, *recv):
            torch._check(size >= 0)
        gate = torch.sigmoid(x.mean(-1, keepdim=True))
        routed = self._exchange(x * gate, recv, send)
        local = torch.arange(e).repeat(n).repeat_interleave(per_source.reshape(-1), output_size=sum(recv))
        perm = torch.sort(local, stable=True).indices
        offsets = torch.cumsum(per_source.sum(0), 0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(routed[perm].bfloat16(), self.w1.bfloat16(), offsets))
        y = torch._grouped_mm(h, self.w2.bfloat16(), offsets).to(x.dtype)
        back = routed.new_empty(routed.shape)
        back[perm] = y
        return self._exchange(back, send, recv) * gate


class MoEWorkload:
    """The MoE layer: T = S/N tokens [T, H] per rank, e = 2 experts [H, F] / [F, H] per rank;
    ``skewed``: half of every rank's tokens go to the next rank, the rest evenly."""

    default_rate = "1gbit"
    variants = ("inductor", "inductor-reorder", "ring", "auto")  # (one pipeline per layer: ring, m = 1)
    quick = {"S": 64, "H": 32, "F": 64}

    def __init__(self, skewed: bool):
        self.skewed = skewed
        self.name = "moe-skewed" if skewed else "moe"

    def quick_sizes(self, n: int) -> dict[str, Any]:
        return {"S": self.quick["S"] * n, "H": self.quick["H"], "F": self.quick["F"]}

    def plan_sizes(self, n: int, bytes_per_second: float, flops: float, compute_ms: float, comm_ratio: float) -> dict[str, Any]:
        """S, H, F such that fw+bw compute ≈ ``compute_ms`` and communication ≈ ``comm_ratio`` of it.

        Per rank (balanced) fw + bw is 12·T·H·F FLOP of grouped matmuls (2 forward, 2 for dX,
        2 for dW), at ``BF16_GROUPED_SPEEDUP`` times the fp32 matmul rate. Four all-to-alls
        (dispatch, combine and their gradients), each moving (N−1)·T·H·4 bytes in all over the
        one shaped link. H = 512; F meets the ratio, T the compute target.
        """
        per_rank = _per_rank_flops(flops, n) * BF16_GROUPED_SPEEDUP
        comm_per_th = 4 * (n - 1) * 4 / bytes_per_second  # seconds per unit of T·H
        f = _round_up(comm_per_th * per_rank / (12 * comm_ratio), 64)
        h = 512
        t = _round_up(compute_ms / 1e3 * per_rank / (12 * h * f), 16 * n)
        return {
            "S": t * n,
            "H": h,
            "F": f,
            "matmul_flops_per_rank": per_rank,
            "link_bytes_per_second": bytes_per_second,
            "estimated_compute_ms": 12 * t * h * f / per_rank * 1e3,
            "estimated_comm_ms": comm_per_th * t * h * 1e3,
        }

    def describe(self, sizes: dict[str, Any], n: int) -> str:
        s, h, f = sizes["S"], sizes["H"], sizes["F"]
        routing = "half of each rank's tokens to the next rank" if self.skewed else "balanced"
        return f"T={s // n} tokens [.., {h}] per rank, {LOCAL_EXPERTS} experts of [{h}, {f}] per rank, {routing}"

    def routing(self, tokens: int, rank: int, n: int) -> torch.Tensor:
        """Each of this rank's tokens' global expert (sorted)."""
        ranks = torch.arange(tokens) % n
        if self.skewed:
            ranks[: tokens // 2] = (rank + 1) % n
        local = torch.arange(tokens) // n % LOCAL_EXPERTS
        return (ranks * LOCAL_EXPERTS + local).sort().values

    def build(self, sizes: dict[str, Any], rank: int, n: int, group: Any) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
        """This rank's layer (its experts), tokens and output gradient."""
        torch._dynamo.config.capture_scalar_outputs = True  # (the splits: .tolist(), as torchtitan's compile sets)
        t, h, f = sizes["S"] // n, sizes["H"], sizes["F"]
        gen = torch.Generator().manual_seed(rank)
        w1 = torch.randn(LOCAL_EXPERTS, h, f, generator=gen) / h**0.5
        w2 = torch.randn(LOCAL_EXPERTS, f, h, generator=gen) / f**0.5
        x = torch.randn(t, h, generator=gen).requires_grad_()
        return ExpertParallelMoE(w1, w2, self.routing(t, rank, n), group, n), x, torch.randn(t, h, generator=gen)

    def compute_only(self, sizes: dict[str, Any], rank: int, n: int) -> Callable[[], None]:
        """The same layer without the all-to-alls (this rank's tokens stay), Inductor."""
        model, x, g = self.build(sizes, rank, n, None)
        model.expert, model.n = model.expert % LOCAL_EXPERTS, 1  # (every token to a local expert)
        return _inductor_step(model, x, g)

    def comm_only(self, sizes: dict[str, Any], n: int, group: Any) -> Callable[[], None]:
        """The all-to-alls of one fw+bw step, eagerly: the count exchange, then dispatch and
        combine and their gradients with this routing's splits."""
        import torch.distributed as dist

        rank, t, h = dist.get_rank(), sizes["S"] // n, sizes["H"]
        counts = torch.bincount(self.routing(t, rank, n) // LOCAL_EXPERTS, minlength=n)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send, recv = counts.tolist(), received.tolist()
        tokens, arrived = torch.randn(t, h), torch.empty(sum(recv), h)

        def step() -> None:
            dist.all_to_all_single(received, counts, group=group)
            for _ in range(2):
                dist.all_to_all_single(arrived, tokens, recv, send, group=group)
                dist.all_to_all_single(tokens, arrived, send, recv, group=group)

        return step


WORKLOADS: dict[str, Any] = {w.name: w for w in (MLPWorkload(), UlyssesWorkload(), MoEWorkload(False), MoEWorkload(True))}
