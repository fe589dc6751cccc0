"""Point-to-point ring transport: ``torch.ops.commfuse.ring_exchange`` and ``wait_exchange``.

``received = ring_exchange(sent, send_to, recv_from, group_name, tag)`` starts an asynchronous
neighbour exchange: send ``sent`` to one peer and receive a tensor of the same shape and dtype
from another, within the process group named ``group_name``. It returns the receive buffer at
once. With ``recv_rows`` the received tensor has that many rows instead (a block of an
all-to-all whose split sizes are known only at run time); an empty tensor is neither sent nor
received (both peers know the size: the sender's block is the receiver's ``recv_rows``). ``wait_exchange(received, sent)`` waits for both transfers and returns ``received`` (a
view, no copy).

No copy is sent: the transport reads ``sent`` itself while the matmul of the step runs, so
``sent`` must stay allocated and unmodified until the wait. ``wait_exchange`` takes it as an
input for that: Inductor, which reuses a buffer once its last reader has run, sees the wait
read it, so it neither frees it nor writes another result into it before then. (Only a sent
tensor that is not contiguous is copied first, by the transport.)

Why a custom op rather than ``_c10d_functional.isend/irecv``: in torch 2.13 those leak one
work-registry entry per call and hang when waited on the send side.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.fx.node import has_side_effect


from ._compat import register_work, resolve_process_group

__all__ = ["WAIT_EXCHANGE", "ring_exchange"]


@torch.library.custom_op("commfuse::ring_exchange", mutates_args=())
def ring_exchange(
    tensor: torch.Tensor, send_to: int, recv_from: int, group_name: str, tag: int, recv_rows: Optional[int] = None
) -> torch.Tensor:
    """Start sending ``tensor`` to group rank ``send_to`` and receiving from ``recv_from``.

    Returns the receive buffer; it is valid only after
    ``torch.ops.commfuse.wait_exchange(result, tensor)``, and ``tensor`` must not be freed or
    modified before then (it is sent as it is). ``tag`` keeps two messages between the same
    pair of ranks apart (with a group of 2, both ring directions reach the same peer).
    ``recv_rows``: the received tensor's dim 0, where it differs from ``tensor``'s.
    """
    group = resolve_process_group(group_name)
    outgoing = tensor.contiguous()  # (a copy only where the tensor is strided)
    incoming = _receive_buffer(outgoing, recv_rows)
    transfers = [
        dist.P2POp(op, buffer, group=group, group_peer=peer, tag=tag)
        for op, buffer, peer in ((dist.isend, outgoing, send_to), (dist.irecv, incoming, recv_from))
        if buffer.numel()  # (an empty block: its peer skips it too)
    ]
    works = dist.batch_isend_irecv(transfers) if transfers else []
    # Waiting on incoming waits on both, so the send is complete before the step moves on.
    for work in works:
        register_work(incoming, work)
    return incoming


@ring_exchange.register_fake
def _(tensor: torch.Tensor, send_to: int, recv_from: int, group_name: str, tag: int, recv_rows: Optional[int] = None) -> torch.Tensor:
    return _receive_buffer(tensor, recv_rows)


def _receive_buffer(sent: torch.Tensor, rows: int | None) -> torch.Tensor:
    if rows is None:
        return torch.empty_like(sent, memory_format=torch.contiguous_format)
    return sent.new_empty((rows, *sent.shape[1:]))


_lib = torch.library.Library("commfuse", "FRAGMENT")
_lib.define("wait_exchange(Tensor(a) received, Tensor sent) -> Tensor(a)")


def _wait_exchange(received: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """Wait for the exchange that receives into ``received`` and sends ``sent``; ``received``."""
    torch.ops._c10d_functional.wait_tensor(received)
    return received.view(received.shape)


def _wait_exchange_meta(received: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    return received.view(received.shape)


_lib.impl("wait_exchange", _wait_exchange, "CompositeExplicitAutograd")
_lib.impl("wait_exchange", _wait_exchange_meta, "Meta")
WAIT_EXCHANGE = torch.ops.commfuse.wait_exchange.default
# A wait is never dead code: it completes the transfers (and releases the work) even where its
# result is not read. (FX's DCE and Inductor's scheduler both ask this registry.)
has_side_effect(WAIT_EXCHANGE)
