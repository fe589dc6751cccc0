"""torchtitan's trainer path on gloo ranks: what ``--compile.enable --compile.backend commfuse``
runs, without the trainer's data loading, checkpointing and logging.

:func:`build` makes torchtitan 0.3.0's Llama3 or dense Qwen3 ``debugmodel`` or its Qwen3
``debugmodel_moe`` (8 experts, top 2; optionally expert parallel) (shrunk: 2 layers, vocab 2048,
SDPA attention) and hands it to the model's own ``parallelize_llama`` /
``parallelize_qwen3``, as ``Trainer.__init__`` does: TP + SP (``model.parallelize``), then
activation checkpointing (``ac``: torchtitan's default per-op selective AC, full AC, or none),
then per-block ``torch.compile`` with the backend named (``apply_compile``), then FSDP2
(``apply_fsdp_to_decoder``, always called). :meth:`Training.step` is the trainer's
``train_step``: forward and loss (torchtitan's ``CrossEntropyLoss``, compiled with the same
backend, as ``--compile.components model,loss`` does) and backward inside the SPMD context,
``dist_utils.clip_grad_norm_`` (max_norm 1.0, ``ep_enabled`` as the trainer passes it) and AdamW with torchtitan's defaults
(``default_adamw``: lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1).

Ranks: TP over ``tp`` consecutive ranks, FSDP over ``world // tp`` (torchtitan's mesh order);
tokens differ between data-parallel ranks and are the same within a TP group.

Workarounds, all here, for what torchtitan 0.3.0 does not do on torch 2.13 with gloo on CPU
(torchtitan itself is untouched; each patch is undone by :func:`build` on return, except the
process-wide switches torchtitan sets itself):

1. mesh device "cpu" while the meshes are built (it falls back to "cuda" without a GPU:
   ``clients._titan_cpu_mesh``); SDPA attention instead of FlexAttention, which has no CPU
   backward (``clients._titan_sdpa_layers``).
2. FSDP2 over the local TP shards: under ``spmd_types`` (torchtitan's default) ``fully_shard``
   on torch 2.13 refuses plain TP shards ("all parameters must be DTensors on the full SPMD
   mesh"), so ``resolve_fsdp_mesh`` gives the 1-D ``dp_shard`` mesh and no mesh dims: each
   rank's TP shard is sharded over its data-parallel group, as FSDP + TP shards do.
3. ``init_weights`` runs just before FSDP wraps the model, inside the SPMD context: the trainer
   initialises after ``parallelize_llama``, but the fused-wqkv init then sees DTensors on the
   1-D mesh with the TP-local shape and no TP size ("The size of tensor a (384) must match the
   size of tensor b (768)"). Every run initialises the same way, so runs are comparable.
4. ``set_force_sum_reduction_for_comms(True)`` on every FSDP module: torchtitan's gradient
   divide factor becomes gloo's missing ``PREMUL_SUM``; summing and then dividing gives the
   same gradients.
5. MoE: ``capture_scalar_outputs`` (process-wide, left set): the EP split sizes come from
   ``.tolist()``, which Dynamo otherwise breaks the graph at. With expert parallelism the
   ``spmd_backend`` is ``partial_dtensor`` (``spmd_types``' eager runtime fails on gloo); its
   FSDP2 meshes are torchtitan's own (workaround 2 only applies under ``spmd_types``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from clients import _titan_cpu_mesh, _titan_sdpa_layers, _titan_vocab
from torch import nn

VOCAB, BATCH, SEQ = 2048, 2, 32
AC_MODES = ("selective", "full", None)


PHASE = "step: "  # (a profiled step's phases: benchmarks/_breakdown.py reads them by this prefix)


def phase(name: str) -> Any:
    """A labelled range of the step in a profile (free when no profiler runs)."""
    return torch.profiler.record_function(PHASE + name)


@dataclasses.dataclass
class Training:
    """One rank's model, loss, optimizer and batch, stepped as torchtitan's trainer steps."""

    model: nn.Module
    loss_fn: Any
    optimizer: torch.optim.Optimizer
    context: Any  # torchtitan's train_context (the SPMD runtime context)
    tokens: torch.Tensor
    labels: torch.Tensor
    global_valid_tokens: torch.Tensor
    ep_enabled: bool = False

    def step(self) -> float:
        """One ``train_step``: returns the loss (this rank's sum over the global token count)."""
        from torchtitan.distributed import utils as dist_utils

        self.optimizer.zero_grad()
        with self.context():
            with phase("forward"):
                pred = self.model(self.tokens)
            with phase("loss"):
                loss, _ = self.loss_fn(pred, self.labels, self.global_valid_tokens)
            del pred
            with phase("backward"):
                loss.backward()
        with phase("grad clipping"):
            dist_utils.clip_grad_norm_(list(self.model.parameters()), max_norm=1.0, foreach=True, ep_enabled=self.ep_enabled)
        with phase("optimizer"):
            self.optimizer.step()
        return loss.item()

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter (FSDP's DTensors as their local part)."""
        return {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for name, p in self.model.named_parameters()}


def build(
    model: str,
    backend: str,
    *,
    tp: int,
    ac: str | None = "selective",
    param_dtype: str = "float32",
    n_layers: int = 2,
    seed: int = 0,
    ep: int = 1,
    spmd_backend: str = "spmd_types",
    dim: int | None = None,
    n_heads: int | None = None,
    batch: int = BATCH,
    seq: int = SEQ,
) -> Training:
    """torchtitan's ``model`` ("llama3", "qwen3" or "qwen3_moe") through its ``parallelize_*``
    on the default process group: TP over ``tp`` ranks, FSDP over the rest, expert parallelism
    over ``ep`` ranks (torchtitan's ``expert_parallel_degree``), activation checkpointing ``ac``
    (one of :data:`AC_MODES`), compiled per block (and the loss) with ``backend``;
    ``param_dtype``: torchtitan's ``training.mixed_precision_param`` ("float32" or its
    default "bfloat16"); ``spmd_backend``: torchtitan's ``parallelism.spmd_backend``. ``dim``
    and ``n_heads`` resize the dense models (:func:`_sized_config`); ``batch`` sequences of
    ``seq`` tokens per data-parallel rank."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if ac not in AC_MODES:
        raise ValueError(f"ac must be one of {AC_MODES}, got {ac!r}")
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"tp={tp} must divide the world size {world}")
    config, parallelize, parallelize_module = _model(model)
    if dim is not None or n_heads is not None:
        config = _sized_config(model, dim or config.dim, n_heads or config.layers[0].attention.n_heads, n_layers)
    _titan_sdpa_layers(config, n_layers, seq)
    _titan_vocab(config, VOCAB)
    parallelism = ParallelismConfig(
        tensor_parallel_degree=tp,
        enable_sequence_parallel=True,
        data_parallel_shard_degree=world // tp,
        expert_parallel_degree=ep,
        spmd_backend=spmd_backend,
    )
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    parallel_dims = ParallelDims.from_config(parallelism, world)
    with _titan_cpu_mesh():
        parallel_dims.build_mesh()
    torch.manual_seed(seed)
    module = config.build()
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    compile_config = CompileConfig(enable=True, backend=backend, components=["model", "loss"])
    with _fsdp_over_local_shards(parallelize_module, context):
        module = parallelize(
            module,
            parallel_dims=parallel_dims,
            training=TrainingConfig(mixed_precision_param=param_dtype),
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config={"selective": SelectiveAC.Config(), "full": FullAC.Config(), None: None}[ac],
            dump_folder="",
        )
    module.train()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB), compile_config=compile_config)
    optimizer = torch.optim.AdamW(module.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    dp_rank = dist.get_rank() // tp  # (the same tokens on the ranks of one TP group)
    data = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(seed + 1 + dp_rank))
    valid = torch.tensor(batch * seq * (world // tp))
    return Training(module, loss_fn, optimizer, context, data[:, :-1], data[:, 1:], valid, parallel_dims.ep_enabled)


def _model(name: str) -> tuple[Any, Any, Any]:
    """The debug config, the ``parallelize_*`` function and its module."""
    if name == "llama3":
        import torchtitan.models.llama3.parallelize as module
        from torchtitan.models.llama3 import llama3_configs

        return llama3_configs["debugmodel"](attn_backend="flex"), module.parallelize_llama, module
    if name == "qwen3":
        import torchtitan.models.qwen3.parallelize as module
        from torchtitan.models.qwen3 import qwen3_configs

        config = qwen3_configs["debugmodel"](attn_backend="flex")
        for layer in config.layers:  # (an FFN of 768, as tests/clients.py's Qwen3)
            ffn = layer.feed_forward
            ffn.w1.out_features = ffn.w3.out_features = ffn.w2.in_features = 768
        return config, module.parallelize_qwen3, module
    if name == "qwen3_moe":
        import torchtitan.models.qwen3.parallelize as module
        from clients import _set_experts
        from torchtitan.models.qwen3 import qwen3_configs

        config = qwen3_configs["debugmodel_moe"](attn_backend="flex")
        for layer in config.layers:
            _set_experts(layer.moe, 8, 2)
        torch._dynamo.config.capture_scalar_outputs = True
        return config, module.parallelize_qwen3, module
    raise ValueError(f"model must be 'llama3', 'qwen3' or 'qwen3_moe', got {name!r}")


def _sized_config(name: str, dim: int, n_heads: int, n_layers: int) -> Any:
    """The dense ``debugmodel`` of ``name`` at width ``dim`` with ``n_heads`` heads, built by
    torchtitan's own layer builders as its ``_debugmodel`` builds the debug size: Llama3 with
    its FFN rule (``compute_ffn_hidden_dim(dim, 256)``), Qwen3 with 4 kv heads (TP 2 or 4)
    and an FFN of ``8 * dim / 3`` rounded up to 256."""
    if name == "llama3":
        import torchtitan.models.llama3 as titan

        return titan.Llama3Model.Config(
            dim=dim,
            vocab_size=VOCAB,
            tok_embeddings=titan.Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=titan._EMBEDDING_INIT),
            norm=titan.RMSNorm.Config(normalized_shape=dim, param_init=titan._NORM_INIT),
            lm_head=titan.Linear.Config(in_features=dim, out_features=VOCAB, param_init=titan._output_linear_init(dim)),
            layers=titan._build_llama3_layers(
                fuse_qkv=True,
                n_layers=n_layers,
                dim=dim,
                n_heads=n_heads,
                hidden_dim=titan.compute_ffn_hidden_dim(dim, multiple_of=256),
                rope=titan.ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
                attn_backend="flex",
            ),
        )
    if name == "qwen3":
        import torchtitan.models.qwen3 as titan

        head_dim = dim // n_heads
        return titan.Qwen3Model.Config(
            vocab_size=VOCAB,
            dim=dim,
            norm=titan._qwen3_norm(dim),
            enable_weight_tying=True,
            tok_embeddings=titan.Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=titan._EMBEDDING_SKIP_INIT),
            lm_head=titan.Linear.Config(in_features=dim, out_features=VOCAB, param_init=titan._LINEAR_INIT),
            layers=titan._build_qwen3_layers(
                fuse_qkv=True,
                n_layers=n_layers,
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=4,
                head_dim=head_dim,
                hidden_dim=-(-8 * dim // 3 // 256) * 256,
                attn_backend="flex",
                rope=titan.CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0),
            ),
        )
    raise ValueError(f"only the dense models resize (llama3, qwen3), got {name!r}")


@contextlib.contextmanager
def _fsdp_over_local_shards(parallelize_module: Any, context: Any) -> Iterator[None]:
    """Workarounds 2-4 (module docstring), patched into the ``parallelize_*`` module's names."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    def resolve_fsdp_mesh(parallel_dims: Any) -> tuple[Any, None]:
        return parallel_dims.get_mesh("dp_shard"), None

    def init_then_fsdp(model: nn.Module, *args: Any, **kwargs: Any) -> None:
        with context(), torch.no_grad():
            model.init_weights()
        apply_fsdp_to_decoder(model, *args, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    saved = parallelize_module.resolve_fsdp_mesh, parallelize_module.apply_fsdp_to_decoder
    parallelize_module.resolve_fsdp_mesh, parallelize_module.apply_fsdp_to_decoder = resolve_fsdp_mesh, init_then_fsdp
    try:
        yield
    finally:
        parallelize_module.resolve_fsdp_mesh, parallelize_module.apply_fsdp_to_decoder = saved
