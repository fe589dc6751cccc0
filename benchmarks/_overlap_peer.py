"""Inductor's overlap scheduler as a peer on CPU, given analytical runtime estimates.

``aten_distributed_optimizations.enable_overlap_scheduling`` moves collective starts earlier and
waits later by estimated runtimes. On CPU its own estimates fail: the compute estimate
benchmarks on a GPU ("Torch not compiled with CUDA enabled"), and the roofline it always
evaluates asks triton for the GPU's memory bandwidth ("0 active drivers" when triton is
installed). :func:`overlap_scheduler_config` picks its analytical estimators and gives it
:func:`cpu_runtime_estimate` (milliseconds, as the hook returns them): a compute node costs its
flops at this machine's measured matmul rate, a collective 50 µs plus (N−1)/N of its bytes at
the link's rate; :func:`patch_cpu_roofline` gives the roofline CPU figures in place of the GPU's
(its result is then overridden by the hook).
"""

from __future__ import annotations

from typing import Any

import torch

LATENCY_MS = 0.05
_rates = {"flops_per_s": 50e9, "link_bytes_per_s": 125e6}


def overlap_scheduler_config(flops_per_s: float, link_bytes_per_s: float) -> dict[str, Any]:
    """The Inductor config patch that runs the overlap scheduler with CPU estimates."""
    _rates.update(flops_per_s=flops_per_s, link_bytes_per_s=link_bytes_per_s)
    patch_cpu_roofline()
    prefix = "aten_distributed_optimizations."
    return {
        prefix + "enable_overlap_scheduling": True,
        prefix + "compute_estimator": "analytical",
        prefix + "collective_estimator": "analytical",
        prefix + "custom_runtime_estimation": cpu_runtime_estimate,
    }


def cpu_runtime_estimate(node: torch.fx.Node, override_size: int | None) -> float | None:
    """Milliseconds of ``node``: flops over the matmul rate, or a collective's transfer time;
    None (the scheduler's default: free) for everything else."""
    import torch.distributed as dist
    from torch._inductor.comm_analysis import estimate_fx_collective_size
    from torch._inductor.fx_passes.overlap_scheduling import (
        _get_flop_registry_key,
        is_compute_node,
    )
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import flop_registry

    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "_c10d_functional":
        if target is torch.ops._c10d_functional.wait_tensor.default:
            return None
        size = estimate_fx_collective_size(node) if override_size is None else override_size
        n = dist.get_world_size()
        return LATENCY_MS + (n - 1) / n * size / _rates["link_bytes_per_s"] * 1e3
    if is_compute_node(node):
        args, kwargs = tree_map(lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a, (node.args, node.kwargs))
        flops = flop_registry[_get_flop_registry_key(target)](*args, **kwargs, out_val=node.meta["val"])
        return float(flops) / _rates["flops_per_s"] * 1e3
    return None


def patch_cpu_roofline() -> None:
    """The roofline the scheduler evaluates for every compute node reads the GPU's memory
    bandwidth and flops through names bound in ``torch.utils._runtime_estimation``: CPU figures."""
    import torch.utils._runtime_estimation as estimation

    estimation.get_gpu_dram_gbps = lambda: 20
    estimation.get_device_tflops = lambda dtype: _rates["flops_per_s"] / 1e12
