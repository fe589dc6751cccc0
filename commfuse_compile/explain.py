"""See what the backend would do, in one process, at any world size.

``fake_world(8)`` sets up a fake process group (no communication) so that a sharded model —
DTensor plans, functional collectives — can be built for 8 ranks on a laptop;
``explain(model, *inputs)`` then compiles its forward and backward exactly as
``backend="commfuse"`` would and returns the :class:`~commfuse_compile.report.Report`::

    with commfuse_compile.fake_world(8):
        model = parallelize_module(Block(), init_device_mesh("cpu", (8,)), plan)
        report = commfuse_compile.explain(model, torch.randn(2, 512, 1024))
    print(report.summary())
    report.to_chrome_trace("steps.json")       # modelled timelines, for Perfetto
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .report import Report, merge_reports, reports

__all__ = ["explain", "fake_world"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """A fake default process group of ``world_size`` ranks, as seen by ``rank``: collectives
    trace and compile at any size without communicating (their results are garbage, their
    shapes right). Yields the group; destroys it on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"fake_world: world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"fake_world: rank must be in [0, {world_size}), got {rank!r}")
    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group is already initialized; call it outside torch.distributed jobs")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def explain(
    model_or_fn: Callable[..., Any],
    *example_inputs: Any,
    options: Mapping[str, Any] | None = None,
    backward: bool = True,
    codegen: bool | None = None,
    device: str = "cpu",
) -> Report:
    """Compile ``model_or_fn`` on ``example_inputs`` as ``backend="commfuse"`` would, forward
    and (if ``backward`` and an output needs grad) backward, and return what the pass did:
    every match with its decision, reason and cost estimates, and the rewritten graphs.

    Runs inside :func:`fake_world` (no communication happens); resets Dynamo's caches and
    bypasses Inductor's, so the pass runs on every graph. Raises ``RuntimeError`` without a
    fake process group: under a real one, explaining would run the collectives.

    ``codegen=False`` stops each graph's compile after Inductor's post-grad passes (the
    commfuse pass is the last of them), so the records and rewritten graphs are the same but
    no kernel is generated: seconds instead of a minute for a model, and the model runs
    eagerly (its unrewritten graphs) to reach the backward.

    ``device="cuda"`` plans a GPU compile on a machine without one (a CPU-only torch will do):
    parameters and inputs may be given on the ``meta`` or CPU device (DTensors over a ``"cpu"``
    mesh); they are replaced by fake tensors, attention goes to the kernel the CUDA dispatcher
    would pick, and the forward and backward graphs are moved to ``cuda:0`` before Inductor's
    post-grad passes and the commfuse pass run on them (see :mod:`.cuda_plan`). Nothing is
    allocated or executed; no code is generated (``codegen`` must not be True).
    """
    from torch._inductor import config as inductor_config

    from .backend import commfuse
    from .options import CommfuseOptions

    if not dist.is_initialized() or dist.get_backend() != "fake":
        raise RuntimeError(
            "commfuse_compile.explain runs without communication: build the model and call it inside "
            "`with commfuse_compile.fake_world(world_size):`"
        )
    CommfuseOptions.from_user(options, environment=True)  # bad options fail here, naming the option (or COMMFUSE_OPTIONS)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"explain: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and codegen:
        raise ValueError("explain(device='cuda') generates no code (no GPU, no Triton here): leave codegen unset or False")
    torch._dynamo.reset()
    seen = len(reports())
    with inductor_config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        if device == "cuda":
            _explain_on_cuda(model_or_fn, example_inputs, options, backward)
        else:
            backend = functools.partial(commfuse, options=options, _inner_compile=None if codegen in (None, True) else _post_grad_only)
            outputs = torch.compile(model_or_fn, backend=backend)(*example_inputs)
            grads = [o for o in _tensors(outputs) if o.requires_grad]
            if backward and grads:
                sum(o.float().sum() for o in grads).backward()
    torch._dynamo.reset()
    return merge_reports(reports()[seen:])


def _explain_on_cuda(model_or_fn: Callable[..., Any], example_inputs: tuple, options: Mapping[str, Any] | None, backward: bool) -> None:
    """Compile forward and (``backward``) backward for ``cuda:0`` on fake tensors: the
    backward is compiled with the forward, so nothing runs backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    from .backend import commfuse
    from .cuda_plan import attention_as_on_cuda, fake_cpu, post_grad_on_cuda, route_attention

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # (constants Inductor folds are real)
    inputs = [fake_cpu(x, mode) for x in example_inputs]
    if not backward:
        inputs = [x.detach() if isinstance(x, torch.Tensor) else x for x in inputs]
    inner = post_grad_on_cuda(run_post_grad_passes)

    def backend(gm: torch.fx.GraphModule, dynamo_inputs: Any) -> Callable[..., Any]:
        route_attention(gm)
        return commfuse(gm, dynamo_inputs, options=options, _inner_compile=inner)

    module = model_or_fn if isinstance(model_or_fn, torch.nn.Module) else None
    state = {}
    if module is not None:
        state = {n: fake_cpu(t, mode) for n, t in (*module.named_parameters(), *module.named_buffers())}
        if not backward:
            state = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in state.items()}
    context = _reparametrize_module(module, state) if module is not None else contextlib.nullcontext()
    grad = contextlib.nullcontext() if backward else torch.no_grad()
    with context, attention_as_on_cuda(), torch._functorch.config.patch(force_non_lazy_backward_lowering=True), grad:
        torch.compile(model_or_fn, backend=backend)(*inputs)


def _post_grad_only(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable[..., Any]:
    """Inductor's per-graph compile up to and including its post-grad passes, as
    ``fx_codegen_and_compile`` runs them, then no code generation: the graph runs as it was."""
    from ._compat import make_boxed_func

    runnable = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    run_post_grad_passes(gm, example_inputs, kwargs.get("is_inference", False))
    return make_boxed_func(runnable.forward)


def run_rewritten(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable[..., Any]:
    """Inductor's per-graph compile up to and including its post-grad passes (the commfuse pass
    the last of them), then no code generation: the rewritten graph runs op by op on ATen
    (``options={"codegen": False}``)."""
    from ._compat import make_boxed_func

    run_post_grad_passes(gm, example_inputs, kwargs.get("is_inference", False))
    gm.recompile()
    return make_boxed_func(gm.forward)


class PostGradDone(Exception):
    """Raised by the commfuse pass when it has run on the graph :func:`run_post_grad_passes`
    stops after (see :func:`stops_here`)."""


_STOP_AFTER: contextvars.ContextVar[torch.fx.Graph | None] = contextvars.ContextVar("commfuse_stop_after", default=None)


def stops_here(graph: torch.fx.Graph) -> bool:
    """Whether the post-grad passes end with the commfuse pass on ``graph``."""
    return _STOP_AFTER.get() is graph


def run_post_grad_passes(gm: torch.fx.GraphModule, example_inputs: Any, is_inference: bool) -> None:
    """What ``fx_codegen_and_compile`` does to ``gm`` before lowering it, in place, up to and
    including the commfuse pass (with a custom post pass other than commfuse's: all of them).

    Inductor's passes after the custom post pass prepare code generation: they refresh every
    changed node's fake tensor (the commfuse pass already set them, so this would compute every
    rewritten node's value a second time), sort again and turn functional ops into in-place
    ones. None of them changes what the graph computes, and a graph run op by op needs none of
    them: skipping them halved the post-grad time of Hugging Face's Qwen3 rewritten at 4 ranks."""
    from ._compat import fake_tensor_prop, post_grad_passes_of, view_to_reshape, virtualized

    view_to_reshape(gm)
    with torch.no_grad():
        fake_mode = fake_tensor_prop(gm, example_inputs)
    stop = _STOP_AFTER.set(gm.graph)
    try:
        with virtualized.V.set_fake_mode(fake_mode):
            post_grad_passes_of(gm, is_inference=is_inference)
    except PostGradDone:
        pass
    finally:
        _STOP_AFTER.reset(stop)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) output, DTensors as their local shards."""
    flat, _ = torch.utils._pytree.tree_flatten(value)
    return [t.to_local() if hasattr(t, "to_local") else t for t in flat if isinstance(t, torch.Tensor)]
