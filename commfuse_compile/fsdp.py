"""Traceable fully-sharded data parallel: FSDP whose collectives reach the compiled graph.

In torch 2.13 FSDP2's ``fully_shard`` gathers parameters and reduce-scatters gradients from
hooks that Dynamo never traces (``torch.distributed.fsdp._fully_shard._fsdp_common._dynamo_disable``),
so no compiled graph — and no commfuse pass — ever sees them. This module shards parameters the
way torchtitan's SimpleFSDP does instead: each parameter is a ``DTensor`` sharded on dim 0, and a
parametrization gathers it where it is used::

    weight = all_gather(weight_shard)        # forward: x @ AG(W).t()  -> Flash-AG, output columns
    grad(weight_shard) = reduce_scatter(dW)  # backward: dY.t() @ x    -> Flash-RS

With ``reshard_after_forward`` (the FSDP default) the gathered weight is not saved for backward:
the all-gather is recomputed there, and backward's ``dY @ AG(W)`` joins a Flash-AG ring along
its contraction dim. Gradients are summed over ranks (each rank's loss term counts once), as
``loss.backward()`` on the concatenated batch would give.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils import parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_RECOMPUTED_IN_BACKWARD = {
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
}


def _recompute_gathers(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE if func in _RECOMPUTED_IN_BACKWARD else CheckpointPolicy.MUST_SAVE


class _GatherParameter(nn.Module):
    """Parametrization: the full parameter from its dim-0 shard; its gradient is reduce-scattered."""

    def __init__(self, reshard_after_forward: bool):
        super().__init__()
        self.reshard_after_forward = reshard_after_forward

    @staticmethod
    def _gather(shard: DTensor) -> torch.Tensor:
        # Partial grad: every rank's gradient is a term of the sum, so backward reduce-scatters it.
        return shard.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))

    def forward(self, shard: DTensor) -> torch.Tensor:
        if not self.reshard_after_forward:
            return self._gather(shard)
        return checkpoint(
            self._gather,
            shard,
            use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_gathers),
            preserve_rng_state=False,
        )


def simple_fsdp(module: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True) -> nn.Module:
    """Shard every parameter of ``module`` on dim 0 over the 1-D ``mesh``, in place; return it.

    Use it instead of ``fully_shard`` when the model is compiled with ``backend="commfuse"``:
    the parameter all-gathers and gradient reduce-scatters then appear in the compiled graphs.
    Parameters become ``DTensor`` shards (``module.<name>.parametrizations.weight.original``);
    optimizers see the shards. Raises ``ValueError`` for a mesh that is not 1-D and for a
    parameter whose dim 0 the mesh size does not divide (the ring needs equal chunks).
    """
    if mesh.ndim != 1:
        raise ValueError(f"simple_fsdp: mesh must be 1-D (the data-parallel dim), got {mesh.ndim}-D; pass mesh['dp']")
    size = mesh.size()
    targets = [(owner, name, param) for owner in module.modules() for name, param in owner.named_parameters(recurse=False)]
    for owner, name, param in targets:
        if isinstance(param, DTensor):
            raise ValueError(f"simple_fsdp: parameter {name!r} of {type(owner).__name__} is already a DTensor")
        if param.dim() == 0 or param.shape[0] % size:
            raise ValueError(
                f"simple_fsdp: parameter {name!r} of {type(owner).__name__} has shape {tuple(param.shape)}; "
                f"dim 0 must be divisible by the mesh size {size}"
            )
    for owner, name, param in targets:
        shard = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]), requires_grad=param.requires_grad)
        setattr(owner, name, shard)
        parametrize.register_parametrization(owner, name, _GatherParameter(reshard_after_forward), unsafe=True)
    return module
