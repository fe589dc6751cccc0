"""Point-to-point ring transport: ``torch.ops.commfuse.ring_exchange``.

One call starts an asynchronous neighbour exchange: send ``tensor`` to one peer and receive a
tensor of the same shape and dtype from another, within the process group named ``group_name``.
It returns the receive buffer at once; the graph later waits on it with
``torch.ops._c10d_functional.wait_tensor`` — the same wait the functional collectives use, so
Inductor treats it like any other asynchronous collective (and the wait is zero-copy).

Why a custom op rather than ``_c10d_functional.isend/irecv``: in torch 2.13 those leak one
work-registry entry per call and hang when waited on the send side.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


from ._compat import register_work, resolve_process_group

__all__ = ["ring_exchange"]


@torch.library.custom_op("commfuse::ring_exchange", mutates_args=())
def ring_exchange(
    tensor: torch.Tensor, send_to: int, recv_from: int, group_name: str, tag: int
) -> torch.Tensor:
    """Start sending ``tensor`` to group rank ``send_to`` and receiving from ``recv_from``.

    Returns the receive buffer; it is valid only after
    ``torch.ops._c10d_functional.wait_tensor(result)``. ``tag`` keeps two messages between the
    same pair of ranks apart (with a group of 2, both ring directions reach the same peer).
    """
    group = resolve_process_group(group_name)
    # Private copy: the caller's buffer may be reused by Inductor before the send completes.
    outgoing = tensor.contiguous().clone()
    incoming = torch.empty_like(outgoing)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, outgoing, group=group, group_peer=send_to, tag=tag),
            dist.P2POp(dist.irecv, incoming, group=group, group_peer=recv_from, tag=tag),
        ]
    )
    # wait_tensor(incoming) waits on both, so the send is complete before the step moves on.
    for work in works:
        register_work(incoming, work)
    return incoming


@ring_exchange.register_fake
def _(tensor: torch.Tensor, send_to: int, recv_from: int, group_name: str, tag: int) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)
