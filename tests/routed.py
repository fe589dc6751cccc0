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


def inputs(rank: int, world: int, dtype: torch.dtype, tokens: int = TOKENS) -> list[torch.Tensor]:
    """This rank's tokens and its expert's weights (leaf tensors)."""
    gen = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    w1 = torch.randn(HIDDEN, FFN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(FFN, HIDDEN, generator=gen) / FFN**0.5
    return [t.to(dtype).requires_grad_() for t in (x, w1, w2)]
