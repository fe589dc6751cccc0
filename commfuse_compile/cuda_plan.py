"""Planning a GPU compile on a machine without a GPU: ``explain(..., device="cuda")``.

A CPU-only torch cannot run autograd on (fake) CUDA tensors: the engine asks the CUDA runtime
for the current stream. So the model is traced as the backend traces it — Dynamo, AOTAutograd,
Inductor's joint-graph passes and partitioner — on fake *CPU* tensors, with the two things a
GPU decides differently decided as a GPU would:

1. **Attention.** ``F.scaled_dot_product_attention`` is routed to the kernel PyTorch's CUDA
   dispatcher would pick (flash, memory-efficient, cuDNN or math, in the priority order and
   with the enable flags of ``torch.nn.attention.sdpa_kernel``), so the forward and backward
   graphs hold the CUDA ops (their shape functions are device-independent).
2. **Device.** Each forward and backward graph is moved to ``cuda:0`` (every ``device``
   argument) and its shapes propagated again on fake CUDA inputs; then Inductor's post-grad
   passes run on it, the commfuse pass last, exactly as in a GPU compile. No kernel is
   generated and nothing is allocated or executed on a device.

What this cannot reproduce: decisions Inductor makes by benchmarking a GPU (``pad_mm``,
autotuning) and code generation itself.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ._compat import make_boxed_func

__all__ = ["attention_as_on_cuda", "cuda_attention", "fake_cpu", "post_grad_on_cuda", "route_attention"]

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten
_SDPA = torch._C._nn.scaled_dot_product_attention
_FLASH, _EFFICIENT, _CUDNN, _MATH = 1, 2, 3, 0  # torch.nn.attention.SDPBackend values


def fake_cpu(value: Any, mode: FakeTensorMode) -> Any:
    """A fake CPU tensor with ``value``'s shape, strides, dtype and requires_grad (a DTensor:
    the same placements over a fake local shard); anything else as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if value.device_mesh.device_type != "cpu":
            raise ValueError(
                f"explain(device='cuda'): the model's DeviceMesh is on {value.device_mesh.device_type!r}; build it "
                "with init_device_mesh('cpu', ...) inside fake_world(...): explain moves the graphs to CUDA itself"
            )
        local = fake_cpu(value.to_local().detach(), mode)
        with mode:
            shard = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
        return torch.nn.Parameter(shard, requires_grad=value.requires_grad) if isinstance(value, torch.nn.Parameter) else shard
    if not isinstance(value, torch.Tensor):
        return value
    with mode:
        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(fake, requires_grad=value.requires_grad)
    return fake.requires_grad_(value.requires_grad)


@contextlib.contextmanager
def attention_as_on_cuda() -> Iterator[None]:
    """Within: :func:`cuda_attention` picks kernels by the ``sdpa_kernel`` choices in force on
    entry, while every kernel is enabled for the trace itself (Dynamo runs attention on the
    CPU fakes, and a CPU has no memory-efficient or cuDNN kernel)."""
    global _choices
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _choices = (
        {
            _FLASH: torch.backends.cuda.flash_sdp_enabled(),
            _EFFICIENT: torch.backends.cuda.mem_efficient_sdp_enabled(),
            _CUDNN: torch.backends.cuda.cudnn_sdp_enabled(),
            _MATH: torch.backends.cuda.math_sdp_enabled(),
        },
        list(torch._C._get_sdp_priority_order()),
    )
    try:
        with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            yield
    finally:
        _choices = None


_choices: tuple[dict[int, bool], list[int]] | None = None


def route_attention(gm: fx.GraphModule) -> list[str]:
    """Point every ``scaled_dot_product_attention`` call of a Dynamo graph at
    :func:`cuda_attention`; returns the names of the calls routed."""
    routed = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _SDPA:
            node.target = cuda_attention
            routed.append(node.name)
    gm.recompile()
    return routed


def cuda_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as the CUDA dispatcher runs it: the first enabled
    kernel, in ``torch._C._get_sdp_priority_order()``, whose main constraints the inputs meet
    (dtype, head dim, mask, causal with as many queries as keys for flash, equal head counts);
    a boolean mask becomes the query's dtype (0 / -inf) for the fused kernels, as there."""
    kernel = _pick_kernel(query, key, value, attn_mask, is_causal, enable_gqa)
    if kernel == _FLASH:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if kernel == _MATH:
        return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
    if attn_mask is not None:  # (what the dispatcher hands the fused kernels: batch and heads expanded)
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    needs_grad = any(t.requires_grad for t in (query, key, value))
    if kernel == _EFFICIENT:
        return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale)[0]
    return aten._scaled_dot_product_cudnn_attention(query, key, value, attn_mask, needs_grad, dropout_p, is_causal, False, scale=scale)[0]


def _pick_kernel(query, key, value, mask, causal, gqa) -> int:
    if _choices is None:
        raise RuntimeError("cuda_attention runs inside attention_as_on_cuda() (explain(device='cuda'))")
    enabled, priority = _choices
    half = query.dtype in (torch.float16, torch.bfloat16)
    head = query.shape[-1]
    plain = query.dim() == 4 and head == value.shape[-1] and head % 8 == 0 and query.shape[1] == key.shape[1] == value.shape[1]
    fits = {
        _FLASH: plain and half and mask is None and head <= 256 and not (causal and query.shape[2] != key.shape[2]),
        _EFFICIENT: plain and (half or query.dtype == torch.float32),
        _CUDNN: plain and half and head <= 128,
        _MATH: True,
    }
    for kernel in priority:
        if enabled.get(kernel) and fits.get(kernel):
            return kernel
    raise RuntimeError(
        "explain(device='cuda'): no enabled scaled_dot_product_attention kernel takes these inputs "
        f"(query {tuple(query.shape)} {query.dtype}, mask {None if mask is None else mask.dtype}); enable one "
        "with torch.nn.attention.sdpa_kernel"
    )


def post_grad_on_cuda(run_post_grad_passes: Callable[..., None]) -> Callable[..., Any]:
    """An Inductor per-graph compile that moves the graph to ``cuda:0``, runs the post-grad
    passes (the commfuse pass the last of them) on fake CUDA inputs and generates no code; the
    graph as it came runs on the CPU fakes, so the forward reaches the backward's compile."""

    def compile_on_cuda(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable[..., Any]:
        runnable = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        mode = torch._guards.detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            _move_to_cuda(gm)
            cuda_inputs = [_on_cuda(x) for x in example_inputs]
        run_post_grad_passes(gm, cuda_inputs, kwargs.get("is_inference", False))
        return make_boxed_func(runnable.forward)

    return compile_on_cuda


def _on_cuda(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=CUDA)
    return value


def _move_to_cuda(gm: fx.GraphModule) -> None:
    """Every ``device`` a node names (factories, copies) becomes ``cuda:0``, and every tensor
    constant a fake one on ``cuda:0`` (the graph is never run; 0-dim ones may stay on the CPU)."""

    def moved(arg: Any) -> Any:
        return CUDA if isinstance(arg, torch.device) and arg.type == "cpu" else arg

    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(constant := getattr(gm, node.target, None), torch.Tensor) and constant.dim():
            setattr(gm, node.target, _on_cuda(constant))
        node.args = fx.node.map_aggregate(node.args, moved)
        node.kwargs = fx.node.map_aggregate(node.kwargs, moved)
    gm.recompile()
