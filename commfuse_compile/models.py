"""A Llama-style transformer block and torchtitan's tensor + sequence parallel plan for it: the
model the tests train, ``examples/llama_block.py`` explains and the benchmarks compile."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm causal attention and a SwiGLU feed-forward, both residual."""

    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def tp_plan(prefix: str = "") -> dict[str, Any]:
    """torchtitan's TP + sequence-parallel plan for one block (module path → style): norms on
    sequence shards, q/k/v and w1/w3 column-parallel, wo and w2 row-parallel back to sequence
    shards. ``prefix``: the block's path in a container (e.g. ``"0."``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    to_replicated = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(**to_replicated),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(**to_replicated),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    return {prefix + key: style for key, style in plan.items()}
