"""Real client models, sharded by their own tensor (+ sequence) parallel code, on CPU under
PyTorch's fake process group: inputs for ``commfuse`` tests that go beyond the project's own
block.

Every builder has the form ``build_X(world_size, **kw) -> (model, inputs)`` and must be called
inside an active ``commfuse_compile.fake_world(world_size)`` (it builds device meshes on the
default group). The models are tiny (dim 256, 2 layers, seq 32, batch 2, fp32), so one forward
+ backward compile takes about a minute on two CPU cores::

    with commfuse_compile.fake_world(8):
        model, inputs = clients.build_titan_llama3(8)
        report = commfuse_compile.explain(model, *inputs, options={"schedule": "ring"})

Importing this module imports neither torchtitan nor transformers; each builder imports what
it needs. Where a client does not run as shipped on CPU under a fake group, the builder patches
it, as little as it can, and its docstring lists every patch.

Builders:

- :func:`build_titan_llama3` -- torchtitan 0.3.0 Llama3 ``debugmodel``, shrunk, through
  ``Module.parallelize(ParallelDims)``, ``spmd_backend="spmd_types"`` or ``"partial_dtensor"``.
- :func:`build_titan_qwen3` -- torchtitan dense Qwen3 ``debugmodel`` (fused QKV, QK-norm,
  weight tying, GQA), same two backends.
- :func:`build_titan_qwen3_moe` -- torchtitan Qwen3 ``debugmodel_moe`` (MoE on every layer),
  TP + SP and optionally expert parallel (EP borrowing the TP ranks).
- :func:`build_hf_llama` / :func:`build_hf_qwen3` -- Hugging Face transformers
  ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` from a config, sharded with the model's stock
  ``base_model_tp_plan``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "build_titan_llama3",
    "build_titan_qwen3",
    "build_titan_qwen3_moe",
    "build_hf_llama",
    "build_hf_qwen3",
    "BUILDERS",
]

BATCH, SEQ = 2, 32


# --------------------------------------------------------------------------------------------
# torchtitan
# --------------------------------------------------------------------------------------------


class SpmdContextModule(nn.Module):
    """Runs ``model`` inside torchtitan's SPMD runtime context, as its trainer's
    ``train_context`` does (``spmd_types`` backend: the current SPMD mesh that every
    redistribution reads). Dynamo traces through the context: one graph, no break."""

    def __init__(self, model: nn.Module, context: Any):
        super().__init__()
        self.model = model
        self._context = context

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._context():
            return self.model(*args, **kwargs)


@contextlib.contextmanager
def _titan_cpu_mesh() -> Iterator[None]:
    """Patch: torchtitan picks its mesh device at import (``tools/utils.py``:
    ``_get_available_device_type() or "cuda"``); ``ParallelDims.build_mesh`` reads that
    module-level name. Point it at "cpu" while the meshes are built, then restore it."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module

    saved = parallel_dims_module.device_type
    parallel_dims_module.device_type = "cpu"
    try:
        yield
    finally:
        parallel_dims_module.device_type = saved


def _titan_sdpa_layers(config: Any, n_layers: int, seq: int) -> None:
    """Keep the first ``n_layers`` layers; give each SDPA attention (causal, no mask) in place
    of FlexAttention, and a RoPE cache of ``seq`` positions."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config.layers = config.layers[:n_layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq)


def _titan_vocab(config: Any, vocab: int) -> None:
    config.vocab_size = vocab
    config.tok_embeddings.num_embeddings = vocab
    config.lm_head.out_features = vocab


def _titan_parallelize(
    config: Any,
    world_size: int,
    spmd_backend: str,
    *,
    ep: int = 1,
    batch: int = BATCH,
    seq: int = SEQ,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The part of torchtitan's ``Trainer.__init__`` that shards a model, without FSDP,
    activation checkpointing, compile or pipelining: ``set_spmd_backend``,
    ``config.update_from_config`` (fills every module's ``sharding_config``),
    ``ParallelDims(tp=world_size, ep=ep)``, ``build``, ``Module.parallelize`` and
    ``init_weights``. Returns the model (wrapped in :class:`SpmdContextModule` under
    ``spmd_types``) and ``(tokens,)``, tokens ``[batch, seq]`` replicated on TP."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.full_dtensor import validate_config

    if spmd_backend not in ("spmd_types", "partial_dtensor"):
        raise ValueError(f"spmd_backend must be 'spmd_types' or 'partial_dtensor', got {spmd_backend!r}")
    if seq % world_size:
        raise ValueError(f"sequence parallel needs seq ({seq}) divisible by world_size ({world_size})")
    parallelism = ParallelismConfig(
        tensor_parallel_degree=world_size,
        enable_sequence_parallel=True,
        data_parallel_shard_degree=1,
        expert_parallel_degree=ep,
        spmd_backend=spmd_backend,
    )
    # Process-wide in torchtitan (distributed/utils.py): the runtime helpers read it in forward.
    dist_utils.set_spmd_backend(spmd_backend)
    # A non-Trainer config: update_from_config only needs .parallelism (it then skips the
    # trainer-only seq_len / debug sync, hence the explicit RoPE max_seq_len above).
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    with _titan_cpu_mesh():
        parallel_dims.build_mesh()
    torch.manual_seed(seed)
    model = config.build()  # on CPU, not meta: the states are real
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    if spmd_backend == "spmd_types":
        # The trainer's order: parallelize (plain local shards), then init the local shards;
        # init_weights reads the current SPMD mesh (e.g. the fused wqkv init picks its TP
        # chunk), so it runs inside the SPMD context.
        validate_config(parallel_dims, model)
        model.parallelize(parallel_dims)
        with context(), torch.no_grad():
            model.init_weights()
        model = SpmdContextModule(model, context)
    else:
        # DTensor random ops on a CPU mesh lack the offset-based RNG tracker (torch warns "DTensor
        # random operators may not have complete support on cpu device mesh"): init the full
        # model first, so every shard is a slice of one init, then parallelize distributes it.
        with torch.no_grad():
            model.init_weights()
        model.parallelize(parallel_dims)
    model.train()
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return model, (tokens,)


def build_titan_llama3(
    world_size: int,
    spmd_backend: str = "spmd_types",
    *,
    n_layers: int = 2,
    vocab: int = 2048,
    batch: int = BATCH,
    seq: int = SEQ,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """torchtitan 0.3.0 Llama3 ``debugmodel`` (dim 256, 16 heads, ffn 768, fused wqkv,
    complex RoPE) shrunk to ``n_layers`` layers, TP + SP over all ``world_size`` ranks through
    its own ``Module.parallelize(ParallelDims)``. ``world_size`` must divide 16 (heads) and
    ``seq``.

    Patches (all in this file; torchtitan itself is untouched):

    1. mesh device "cpu": ``torchtitan.distributed.parallel_dims.device_type`` is set to
       "cpu" while ``build_mesh`` runs (it falls back to "cuda" without a GPU), then restored.
    2. attention: every layer's ``inner_attention`` is ``ScaledDotProductAttention.Config()``
       (causal SDPA, no mask) instead of FlexAttention, which has no CPU backward;
       ``get_attention_config("sdpa")`` refuses for language models in 0.3.0, so the config is
       swapped after the debug config is built, before ``update_from_config``.
    3. config shrink: ``layers[:n_layers]``, RoPE ``max_seq_len = seq`` (the trainer syncs it to
       ``training.seq_len``; ``update_from_config`` with a non-Trainer config does not).
    4. ``update_from_config`` gets ``SimpleNamespace(parallelism=ParallelismConfig(...))``
       (tp = world_size, SP on, dp_shard = 1) instead of a full ``Trainer.Config``.
    5. ``set_spmd_backend(spmd_backend)`` is called (torchtitan's process-wide switch the
       trainer sets): the last builder called wins for the whole process.
    6. ``spmd_types``: ``init_weights`` runs inside ``get_spmd_context(parallel_dims)`` (outside
       it the fused-wqkv init sees TP size 1 and fails: "The size of tensor a (96) must match
       the size of tensor b (768)"), and the returned model is :class:`SpmdContextModule`, which
       enters that context around each forward (the trainer's ``train_context``).
    7. ``partial_dtensor``: ``init_weights`` runs on the unsharded model, before
       ``parallelize`` (the trainer's order, parallelize then init, does run, but DTensor random
       init on a CPU mesh has no offset-based RNG tracker and warns; this way every shard is a
       slice of one full init).

    Not applied (trainer parts outside TP): FSDP wrapping (``apply_fsdp_to_decoder``),
    activation checkpointing, per-block compile, input SPMD type annotation/typechecking.
    """
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    _titan_sdpa_layers(config, n_layers, seq)
    _titan_vocab(config, vocab)
    return _titan_parallelize(config, world_size, spmd_backend, batch=batch, seq=seq)


def build_titan_qwen3(
    world_size: int,
    spmd_backend: str = "spmd_types",
    *,
    n_layers: int = 2,
    hidden_dim: int = 768,
    vocab: int = 2048,
    batch: int = BATCH,
    seq: int = SEQ,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """torchtitan 0.3.0 dense Qwen3 ``debugmodel`` (dim 256, 16 heads / 8 kv heads of 128,
    fused wqkv, QK-norm, cos/sin RoPE, tied embedding / lm_head) shrunk to ``n_layers``
    layers and an FFN of ``hidden_dim`` (3072 in the debug config), TP + SP over
    ``world_size`` ranks through ``Module.parallelize``. ``world_size`` must divide 8 (kv
    heads) and ``seq``.

    Patches: the same seven as :func:`build_titan_llama3` (CPU mesh device, SDPA attention,
    shrink incl. RoPE ``max_seq_len``, SimpleNamespace config, ``set_spmd_backend``, SPMD
    context around init and forward / full init before parallelize for DTensor), plus the FFN
    ``hidden_dim`` of every layer (w1 / w3 ``out_features``, w2 ``in_features``).
    """
    from torchtitan.models.qwen3 import qwen3_configs

    config = qwen3_configs["debugmodel"](attn_backend="flex")
    _titan_sdpa_layers(config, n_layers, seq)
    _titan_vocab(config, vocab)
    for layer in config.layers:
        ffn = layer.feed_forward
        ffn.w1.out_features = ffn.w3.out_features = ffn.w2.in_features = hidden_dim
        if hasattr(ffn, "hidden_dim"):
            ffn.hidden_dim = hidden_dim
    return _titan_parallelize(config, world_size, spmd_backend, batch=batch, seq=seq)


def build_titan_qwen3_moe(
    world_size: int,
    spmd_backend: str = "spmd_types",
    *,
    ep: int = 1,
    n_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    vocab: int = 2048,
    batch: int = BATCH,
    seq: int = SEQ,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """torchtitan 0.3.0 Qwen3 ``debugmodel_moe`` (dense attention as :func:`build_titan_qwen3`,
    an MoE FFN on every layer: softmax router, ``num_experts`` grouped experts of hidden 768,
    top-``top_k``) shrunk to ``n_layers`` layers, TP + SP over ``world_size`` ranks; ``ep > 1``
    also turns on expert parallelism (EP borrows the TP ranks: ``ep`` must equal
    ``world_size``), whose token dispatch is an all-to-all.

    Patches: the same seven as :func:`build_titan_llama3`, plus the MoE shrink (router
    ``num_experts`` / ``top_k``, routed experts ``num_experts`` / ``top_k``, every place the
    config carries them, and the router gate's ``out_features``). With ``ep > 1`` two more:

    8. fake token-count exchange (under the fake process group only): each ``AllToAllTokenDispatcher._token_count_exchange`` (an
       instance attribute, the class is untouched) returns this rank's own counts as if every
       rank had routed the same way (``counts.view(ep, -1).clone()``, what the fake group
       gives in eager) instead of an all-to-all. Compiled, the fake all-to-all's output is
       uninitialised memory, the data all-to-all's split sizes then disagree with its input
       and the fake group raises ``alltoall_base: inputBuffer is empty but outputSplitSizes[i]
       > 0``. The token dispatch / combine all-to-alls stay as they are.
    9. ``torch._dynamo.config.capture_scalar_outputs = True`` (process-wide, left set), with
       ``ep > 1`` or ``spmd_backend="partial_dtensor"``. EP: the split sizes come from
       ``.tolist()``; without it Dynamo breaks the graph there, the model compiles as ~20
       fragments and the shared ``forward_with_redistribution`` code hits the recompile limit,
       so later layers run eagerly and their sites never reach commfuse. ``partial_dtensor``
       (also at ``ep=1``): AOT tracing of the DTensor MoE hits a data-dependent
       ``aten._local_scalar_dense``; the backend fails, Dynamo breaks the graph at the model's
       return and the backward then fails ("Expected a DTensor tangent but got a plain
       Tensor", the router's ``topk`` ids output).
    """
    from torchtitan.models.qwen3 import qwen3_configs

    config = qwen3_configs["debugmodel_moe"](attn_backend="flex")
    _titan_sdpa_layers(config, n_layers, seq)
    _titan_vocab(config, vocab)
    for layer in config.layers:
        _set_experts(layer.moe, num_experts, top_k)
    if ep > 1 and ep != world_size:
        raise ValueError(f"ep must be 1 or world_size ({world_size}), got {ep}")
    model, inputs = _titan_parallelize(config, world_size, spmd_backend, ep=ep, batch=batch, seq=seq)
    if ep > 1 and dist.get_backend() == "fake":  # (on real ranks the real count exchange runs)
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

        for module in model.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if isinstance(dispatcher, AllToAllTokenDispatcher):
                dispatcher._token_count_exchange = types.MethodType(_same_routing_count_exchange, dispatcher)
    if ep > 1 or spmd_backend == "partial_dtensor":
        torch._dynamo.config.capture_scalar_outputs = True
    return model, inputs


def _same_routing_count_exchange(self: Any, counts: torch.Tensor, pg: Any, ep_size: int) -> torch.Tensor:
    """The EP token-count exchange under a fake group: every rank routed as this one did."""
    return counts.view(ep_size, -1).clone()


def _set_experts(cfg: Any, num_experts: int, top_k: int) -> None:
    """Set ``num_experts`` / ``top_k`` wherever a (nested) MoE config dataclass has them."""
    if not dataclasses.is_dataclass(cfg):
        return
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name == "num_experts":
            setattr(cfg, field.name, num_experts)
        elif field.name == "gate":  # the router's Linear: one logit per expert
            value.out_features = num_experts
        elif field.name == "top_k":
            setattr(cfg, field.name, top_k)
        elif dataclasses.is_dataclass(value):
            _set_experts(value, num_experts, top_k)


# --------------------------------------------------------------------------------------------
# Hugging Face transformers
# --------------------------------------------------------------------------------------------


def _hf_distribute(model: nn.Module, world_size: int) -> nn.Module:
    """Shard ``model`` with its stock TP plan through the two steps ``from_pretrained(...,
    distributed_config=DistributedConfig(tp_size=world_size))`` runs before it loads weights:
    ``prepare_distribute_model`` (the ``(pp, dp_replicate, fsdp, tp)`` mesh on
    ``torch._C._get_accelerator()``, "cpu" here, on the already initialised default group) and
    ``maybe_distribute_model`` (``_resolve_parallel_plans``: ``base_model_tp_plan`` + the class
    ``_tp_plan``; then ``apply_tensor_parallelism``). Parameters become DTensors
    (``distribute_tensor(..., src_data_rank=None)``: each rank slices its own, identically seeded
    copy, no communication)."""
    from transformers.distributed import DistributedConfig

    config, _device_map, mesh_manager = type(model).prepare_distribute_model(DistributedConfig(tp_size=world_size))
    return type(model).maybe_distribute_model(model, config, mesh_manager)


class LogitsOnly(nn.Module):
    """``model(input_ids).logits``: a plain tensor output (what ``tests/graphs.py``'s
    ``post_grad_graphs`` and ``explain`` sum for the backward), instead of a ModelOutput."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def _hf_build(model_cls: Any, config: Any, world_size: int, batch: int, seq: int, seed: int = 0):
    torch.manual_seed(seed)
    model = LogitsOnly(_hf_distribute(model_cls(config), world_size))
    model.train()
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return model, (input_ids,)


def _aot_rng_states_before_opaque_objects() -> None:
    """Workaround for torch 2.13's AOTAutograd, installed by ``gradient_checkpointing=True``
    (process-wide, once; a graph without the bug is partitioned exactly as before).

    Under Hugging Face's ``gradient_checkpointing_enable()`` with its TP plan, the checkpointed
    layers read the DeviceMesh (an opaque graph input, saved for backward) and hold a
    recomputed random op (attention dropout, p = 0). The partitioner's
    ``functionalize_rng_ops`` appends the random op's saved RNG state after the saved opaque
    objects, where the runtime expects only opaque objects and symbols: the first forward
    fails under every backend (``expected all tensors_saved_with_vc_check to be Tensors``).
    Here the RNG states go before the opaque objects, among the saved tensors, in the forward's
    outputs and the backward's inputs alike."""
    import torch._functorch.partitioners as partitioners
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node

    if getattr(partitioners.functionalize_rng_ops, "_commfuse_tests", False):
        return
    original = partitioners.functionalize_rng_ops

    def functionalize_rng_ops(joint_module: Any, fw_module: Any, bw_module: Any, num_sym_nodes: int) -> Any:
        outputs = next(iter(fw_module.graph.find_nodes(op="output"))).args[0]
        saved = outputs[: len(outputs) - num_sym_nodes]
        opaque = 0
        while opaque < len(saved) and is_opaque_node(saved[len(saved) - 1 - opaque]):
            opaque += 1
        inputs_before = {node.name for node in bw_module.graph.find_nodes(op="placeholder")}
        # (the states are inserted before the last ``num_sym_nodes`` outputs: count the opaque ones too)
        fw_module, bw_module = original(joint_module, fw_module, bw_module, num_sym_nodes + opaque)
        placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
        first_opaque = next((node for node in placeholders if is_opaque_node(node)), None)
        if opaque and first_opaque is not None:
            for node in placeholders:
                if node.name not in inputs_before:  # the RNG states, placed before the tangents
                    first_opaque.prepend(node)
            bw_module.recompile()
        return fw_module, bw_module

    functionalize_rng_ops._commfuse_tests = True
    functionalize_rng_ops.original = original
    partitioners.functionalize_rng_ops = functionalize_rng_ops


def build_hf_llama(
    world_size: int,
    *,
    hidden_size: int = 256,
    heads: int = 8,
    kv_heads: int = 8,
    intermediate_size: int = 512,
    n_layers: int = 2,
    vocab: int = 512,
    batch: int = BATCH,
    seq: int = SEQ,
    gradient_checkpointing: bool = False,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Hugging Face transformers ``LlamaForCausalLM`` from a ``LlamaConfig`` (random init, no
    download), sharded with its stock TP plan: q/k/v/gate/up ``colwise``, o/down ``rowwise``
    (output Replicate: an all-reduce, HF has no sequence parallel), ``embed_tokens``
    ``embedding_rowwise`` (vocab-sharded, all-reduced), ``lm_head`` ``colwise_gather_output``
    (all-gather of the vocab shards after the matmul). ``world_size`` must divide ``heads`` and
    ``kv_heads``. Inputs: ``(input_ids,)``, replicated; the model is wrapped in
    :class:`LogitsOnly` (returns the replicated logits tensor).

    Patches: none to transformers. ``from_pretrained(..., distributed_config=...)`` itself is not
    usable here (in 5.23 any ``tp_plan`` / ``distributed_config`` load requires ``accelerate``,
    not installed), so the builder calls its two distribution steps directly (see
    :func:`_hf_distribute`) on a model built from the config. ``use_cache=False`` and
    ``attn_implementation="sdpa"`` are set in the config.

    ``gradient_checkpointing``: ``model.gradient_checkpointing_enable()``, as its users turn it on
    (each decoder layer recomputed in backward), and a workaround for torch 2.13's AOTAutograd
    that every backend needs for it (:func:`_aot_rng_states_before_opaque_objects`).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(seq, 64),
        use_cache=False,
        attn_implementation="sdpa",
    )
    model, inputs = _hf_build(LlamaForCausalLM, config, world_size, batch, seq)
    if gradient_checkpointing:
        _aot_rng_states_before_opaque_objects()
        model.model.gradient_checkpointing_enable()
    return model, inputs


def build_hf_qwen3(
    world_size: int,
    *,
    hidden_size: int = 256,
    heads: int = 16,
    kv_heads: int = 8,
    head_dim: int = 32,
    intermediate_size: int = 512,
    n_layers: int = 2,
    vocab: int = 512,
    batch: int = BATCH,
    seq: int = SEQ,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Hugging Face transformers ``Qwen3ForCausalLM`` from a ``Qwen3Config`` (GQA 16 / 8 heads of
    32, QK-norm), sharded with its stock TP plan: as :func:`build_hf_llama`, plus ``q_norm`` /
    ``k_norm`` ``replicated_with_grad_allreduce`` (a post-accumulate-grad hook that all-reduces
    the norm weights' grads, eagerly, outside the compiled graphs). ``world_size`` must divide
    ``heads`` and ``kv_heads``.

    Patches: none; the same direct distribution steps as :func:`build_hf_llama`.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max(seq, 64),
        use_cache=False,
        attn_implementation="sdpa",
    )
    return _hf_build(Qwen3ForCausalLM, config, world_size, batch, seq)


BUILDERS = {
    "titan_llama3": build_titan_llama3,
    "titan_qwen3": build_titan_qwen3,
    "titan_qwen3_moe": build_titan_qwen3_moe,
    "hf_llama": build_hf_llama,
    "hf_qwen3": build_hf_qwen3,
}
