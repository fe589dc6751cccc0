"""A token-routed expert-parallel MoE layer whose all-to-all splits are known only at run time.

Each rank holds T tokens and one expert per rank; a routing (drawn per call from a seed every
rank knows) sends each token to one rank's expert. The layer does what an MoE token dispatcher
does: count the tokens per destination, exchange the counts (an all-to-all of [N] int64, read on
the host with ``.tolist()``), dispatch the tokens sorted by destination with those splits, run
the expert FFN on what arrived, and combine the results back with the splits swapped. The split
sizes are unbacked SymInts in the compiled graph, so one compile serves every routing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

TOKENS, HIDDEN, FFN = 12, 16, 32


def routed_moe(x, w1, w2, destination):
    """x [T, H] sorted by ``destination`` (int64 [T], the rank whose expert takes each token)."""
    group = dist.group.WORLD
    n = dist.get_world_size()
    counts = (destination.unsqueeze(1) == torch.arange(n)).sum(0)  # tokens this rank sends to each rank
    received = funcol.all_to_all_single(counts, None, None, group)  # tokens each rank sends here
    send, recv = counts.tolist(), received.tolist()
    for size in (*send, *recv):
        torch._check(size >= 0)
    gate = torch.sigmoid(x.mean(-1, keepdim=True))
    routed = funcol.all_to_all_single_autograd(x * gate, recv, send, group)
    y = F.silu(routed @ w1) @ w2
    back = funcol.all_to_all_single_autograd(y, send, recv, group)
    return back * gate


LOCAL_EXPERTS = 2


def grouped_experts(x, w1, w2, expert):
    """An MoE layer as torchtitan's all-to-all token dispatcher runs it: each token (sorted by
    ``expert``, its global expert of N·e) goes to the rank holding that expert; the rank permutes
    what arrived from rank-major (by source rank) to expert-major order, runs its e experts as
    grouped matmuls (``torch._grouped_mm`` with cumulative offsets; w1 [e, H, F], w2 [e, F, H]),
    permutes back and combines. The experts compute in bf16, as torchtitan's do (and as CPU's
    grouped matmul requires)."""
    group = dist.group.WORLD
    n, e = dist.get_world_size(), w1.shape[0]
    counts = (expert.unsqueeze(1) == torch.arange(n * e)).sum(0)  # my tokens per global expert
    per_source = funcol.all_to_all_single(counts.view(n, e), None, None, group)  # T: [source rank, my expert]
    send, recv = counts.view(n, e).sum(1).tolist(), per_source.sum(1).tolist()
    for size in (*send, *recv):
        torch._check(size >= 0)
    gate = torch.sigmoid(x.mean(-1, keepdim=True))
    routed = funcol.all_to_all_single_autograd(x * gate, recv, send, group)
    # rank-major (source j, then its tokens by my expert) -> expert-major
    rows = sum(recv)
    local = torch.arange(e).repeat(n).repeat_interleave(per_source.reshape(-1), output_size=rows)
    perm = torch.sort(local, stable=True).indices
    offsets = torch.cumsum(per_source.sum(0), 0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(routed[perm].bfloat16(), w1.bfloat16(), offsets))  # (CPU: bf16 only)
    y = torch._grouped_mm(h, w2.bfloat16(), offsets).to(x.dtype)
    back = routed.new_empty(routed.shape)
    back[perm] = y
    out = funcol.all_to_all_single_autograd(back, send, recv, group)
    return out * gate


def two_expert_layers(x, w1, w2, expert):
    """Two such MoE layers back to back, the second routed to the next rank's experts: two
    pipelines in a row each way, for ordering and matching peers."""
    n = dist.get_world_size() * LOCAL_EXPERTS
    h = grouped_experts(x, w1, w2, expert)
    return grouped_experts(h, w1.flip(0), w2, ((expert + LOCAL_EXPERTS) % n).sort().values)


def two_layers(x, w1, w2, destination):
    """Two MoE layers back to back, the second routed differently (its tokens rolled by one
    destination): four runtime-split all-to-alls in a row, for ordering and matching peers."""
    n = dist.get_world_size()
    h = routed_moe(x, w1, w2, destination)
    return routed_moe(h, w1.flip(1), w2, ((destination + 1) % n).sort().values)


def routing(kind: str, rank: int, world: int, call: int, tokens: int = TOKENS) -> torch.Tensor:
    """The destination of each of this rank's tokens, sorted: ``balanced`` (T/N each),
    ``one_rank`` (every token to rank (call mod N)), ``local`` (all to itself), ``random`` (from a
    seed), ``empty_rank`` (random, never to the last rank)."""
    if kind == "balanced":
        dest = torch.arange(tokens) % world
    elif kind == "one_rank":
        dest = torch.full((tokens,), call % world)
    elif kind == "local":
        dest = torch.full((tokens,), rank)
    else:
        gen = torch.Generator().manual_seed(1000 * call + rank)
        high = world - 1 if kind == "empty_rank" else world
        dest = torch.randint(0, high, (tokens,), generator=gen)
    return dest.sort().values


def expert_routing(kind: str, rank: int, world: int, call: int, tokens: int = TOKENS) -> torch.Tensor:
    """Each token's global expert (of N·e), sorted: as :func:`routing` by rank, with the
    expert within the rank from a seed (``empty_expert``: never a rank's last expert)."""
    rank_of = routing("random" if kind == "empty_expert" else kind, rank, world, call, tokens)
    gen = torch.Generator().manual_seed(7 + 1000 * call + rank)
    high = LOCAL_EXPERTS - 1 if kind == "empty_expert" else LOCAL_EXPERTS
    return (rank_of * LOCAL_EXPERTS + torch.randint(0, high, (tokens,), generator=gen)).sort().values


def expert_inputs(rank: int, world: int, dtype: torch.dtype, tokens: int = TOKENS) -> list[torch.Tensor]:
    """This rank's tokens and its e experts' weights (leaf tensors)."""
    gen = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    w1 = torch.randn(LOCAL_EXPERTS, HIDDEN, FFN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(LOCAL_EXPERTS, FFN, HIDDEN, generator=gen) / FFN**0.5
    return [t.to(dtype).requires_grad_() for t in (x, w1, w2)]


def inputs(rank: int, world: int, dtype: torch.dtype, tokens: int = TOKENS) -> list[torch.Tensor]:
    """This rank's tokens and its expert's weights (leaf tensors)."""
    gen = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    w1 = torch.randn(HIDDEN, FFN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(FFN, HIDDEN, generator=gen) / FFN**0.5
    return [t.to(dtype).requires_grad_() for t in (x, w1, w2)]
