"""The private torch APIs commfuse relies on, imported in one place.

If a torch release moves one of them, importing commfuse fails here with a message that names the
missing API and the torch version, instead of an obscure error deep inside a compile.
"""

from __future__ import annotations

import torch

TESTED_TORCH = "2.13"


def _missing(what: str, err: Exception) -> ImportError:
    return ImportError(
        f"commfuse_compile needs {what}, which torch {torch.__version__} does not provide "
        f"({err}). commfuse is tested with torch {TESTED_TORCH}; install torch=={TESTED_TORCH}.0."
    )


try:
    from torch._C._distributed_c10d import _register_work as register_work
    from torch._C._distributed_c10d import _get_work_registry_size as work_registry_size
except ImportError as err:  # pragma: no cover - depends on the torch build
    raise _missing("torch._C._distributed_c10d._register_work (c10d work registry)", err) from err

try:
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass, get_hash_for_files
except ImportError as err:  # pragma: no cover
    raise _missing("torch._inductor.custom_graph_pass.CustomInferenceAwareGraphPass", err) from err

try:
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
except ImportError as err:  # pragma: no cover
    raise _missing("torch._inductor.fx_passes.control_dependencies.preserve_node_ordering", err) from err

try:
    from torch._inductor.pattern_matcher import stable_topological_sort
except ImportError as err:  # pragma: no cover
    raise _missing("torch._inductor.pattern_matcher.stable_topological_sort", err) from err

try:  # explain(codegen=False): Inductor's steps before code generation
    from torch._functorch._aot_autograd.utils import make_boxed_func
    from torch._inductor import virtualized
    from torch._inductor.compile_fx import _recursive_post_grad_passes as post_grad_passes_of
    from torch._inductor.compile_fx import fake_tensor_prop
    from torch._inductor.fx_passes.post_grad import view_to_reshape
except ImportError as err:  # pragma: no cover
    raise _missing("torch._inductor.compile_fx._recursive_post_grad_passes / fake_tensor_prop", err) from err

try:
    from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
except ImportError as err:  # pragma: no cover
    raise _missing("torch.distributed.distributed_c10d._resolve_process_group", err) from err

__all__ = [
    "CustomInferenceAwareGraphPass",
    "fake_tensor_prop",
    "make_boxed_func",
    "post_grad_passes_of",
    "view_to_reshape",
    "virtualized",
    "get_hash_for_files",
    "preserve_node_ordering",
    "register_work",
    "resolve_process_group",
    "stable_topological_sort",
    "work_registry_size",
]
