"""Real clients, installed as packages: torchtitan 0.3.0 and Hugging Face transformers 5.23.

Each model is sharded by the client's own tensor (+ sequence) parallel code (``tests/clients.py``
builds them and lists what had to be patched to run on CPU) and planned at world size 8 on the
fake process group with ``explain(codegen=False)`` — the pass runs on the real post-grad forward
and backward graphs; no kernel is generated. The counts are exact: a change in what commfuse
rewrites in a client's graphs fails here.

What is left alone, and why (docs/coverage.md, "Coverage by client"):
- torchtitan, the embedding's reduce-scatter and its gradient's all-gather: the embedding is a
  row lookup, not a matmul (``produced by mul.Tensor`` / ``no matmul reads the gathered tensor``).
- torchtitan MoE: the experts' output is scattered back to the tokens (``deterministic_scatter_add``,
  ``index_put``) before the reduce-scatter, and the gathered gradient reaches the experts through a
  token gather: no matmul next to the collective.
- Hugging Face: plain TP, an all-reduce after every row-parallel linear and before every
  column-parallel one's input gradient: each is split into Flash-RS and Flash-AG
  (``passes/all_reduce.py``); see PLAIN_TP for the halves left as plain collectives.
  ``lm_head``'s all-gather comes after its matmul.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from clients import BUILDERS

import commfuse_compile
from commfuse_compile.backend import commfuse
from commfuse_compile.explain import _post_grad_only
from commfuse_compile.report import merge_reports

pytestmark = pytest.mark.slow  # (a minute in all: eight real models traced and planned)

WORLD = 8
AG, RS, AR = "all_gather_matmul", "matmul_reduce_scatter", "all_reduce"
EMBEDDING_SKIPS = {
    ("forward", RS): "reduce-scatter input is produced by mul.Tensor",
    ("backward", AG): "no matmul reads the gathered tensor",
}
# (graph, pattern) -> (sites, rewritten); 2 layers each.
DENSE = {("forward", AG): (5, 5), ("forward", RS): (5, 4), ("backward", AG): (5, 4), ("backward", RS): (5, 5)}
# Hugging Face's plain TP, 2 layers: every all-reduce is split into a reduce-scatter and an
# all-gather (their sites counted under their own patterns; the forward's 6th gather is
# lm_head's, after its matmul). Forward: the embedding's reduce-scatter is not after a matmul;
# the last gather feeds only the final norm and lm_head's gather. Backward: the gradients of
# q, k and v (and of gate and up) are all-reduced apart and added before the norm's backward,
# so one gather of each sum takes the matmul and the others are plain gathers; the last ones
# feed the embedding's gradient (no matmul).
PLAIN_TP = {
    ("forward", AR): (5, 5), ("forward", RS): (5, 4), ("forward", AG): (6, 5),
    ("backward", AR): (11, 11), ("backward", RS): (11, 11), ("backward", AG): (11, 4),
}
# With ``gradient_checkpointing_enable()`` each layer's forward is recomputed in backward: its
# all-reduces (3 of the 5: the embedding's is not in a checkpointed layer) again, and split as
# in the forward; two more backward gathers take a matmul (the recomputed q/k/v and gate/up).
PLAIN_TP_CHECKPOINTED = {
    ("forward", AR): (5, 5), ("forward", RS): (5, 4), ("forward", AG): (6, 5),
    ("backward", AR): (14, 14), ("backward", RS): (14, 14), ("backward", AG): (14, 6),
}
CASES = {
    "titan_llama3-spmd_types": ("titan_llama3", {"spmd_backend": "spmd_types"}, DENSE),
    "titan_llama3-partial_dtensor": ("titan_llama3", {"spmd_backend": "partial_dtensor"}, DENSE),
    "titan_qwen3-spmd_types": ("titan_qwen3", {"spmd_backend": "spmd_types"}, DENSE),
    "titan_qwen3-partial_dtensor": ("titan_qwen3", {"spmd_backend": "partial_dtensor"}, DENSE),
    "titan_qwen3_moe-spmd_types": (
        "titan_qwen3_moe",
        {"spmd_backend": "spmd_types"},
        {("forward", AG): (5, 5), ("forward", RS): (5, 2), ("backward", AG): (5, 2), ("backward", RS): (5, 3)},
    ),
    "titan_qwen3_moe-ep8": (
        "titan_qwen3_moe",
        {"spmd_backend": "spmd_types", "ep": WORLD},
        {
            ("forward", AG): (3, 3), ("forward", RS): (3, 2), ("backward", AG): (3, 2), ("backward", RS): (3, 3),
            # each layer's dispatch → experts → combine as one moe_ep pipeline, forward and
            # backward (its dispatch and combine all-to-alls have no site of their own)
            ("forward", "moe_ep"): (2, 2), ("backward", "moe_ep"): (2, 2),
        },
    ),
    "hf_llama": ("hf_llama", {}, PLAIN_TP),
    "hf_llama-gradient_checkpointing": ("hf_llama", {"gradient_checkpointing": True}, PLAIN_TP_CHECKPOINTED),
    "hf_qwen3": ("hf_qwen3", {}, PLAIN_TP),
}


@pytest.fixture(scope="module")
def world():
    with commfuse_compile.fake_world(WORLD):
        yield


# (titan_llama3 under spmd_types, torchtitan's default, is checked by the dynamic-batch test
# below: its first compile is this one)
@pytest.mark.parametrize("case", [case for case in CASES if case != "titan_llama3-spmd_types"])
def test_client_sites_at_world_size_8(world, case):
    builder, kwargs, expected = CASES[case]
    model, inputs = BUILDERS[builder](WORLD, **kwargs)
    report = commfuse_compile.explain(model, *inputs, options={"schedule": "ring"}, codegen=False)
    _check_sites(report, builder, expected)


def _check_sites(report, builder: str, expected: dict) -> None:
    """Every (graph, pattern) has the expected (sites, rewritten), and every skip a reason."""
    sites = Counter((s.graph, s.pattern) for s in report.sites)
    rewritten = Counter((s.graph, s.pattern) for s in report.rewritten)
    assert {key: (sites[key], rewritten[key]) for key in sites} == expected, report.summary()
    if builder.startswith("titan"):  # the embedding's collectives, left alone with their reason
        for where, reason in EMBEDDING_SKIPS.items():
            assert any(s.reason.startswith(reason) for s in report.skipped if (s.graph, s.pattern) == where), report.summary()
    for site in report.skipped:
        assert site.reason, site


def test_dynamic_batch_keeps_every_rewrite(world):
    """torch.compile's default ``dynamic=None``: a second batch size recompiles torchtitan's
    Llama3 with the batch symbolic. The cut dim (the sequence) stays static, so the same 18
    sites are rewritten in the symbolic graphs, and a third batch size compiles nothing. The
    first compile (static, the builder's batch of 2) is checked site by site as the other
    clients are in ``test_client_sites_at_world_size_8``."""
    builder, kwargs, expected = CASES["titan_llama3-spmd_types"]
    model, (tokens,) = BUILDERS[builder](WORLD, **kwargs)
    backend = functools.partial(commfuse, options={"schedule": "ring"}, _inner_compile=_post_grad_only)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    rewritten, symbolic, reports = [], [], []
    for batch in (tokens, *(torch.randint(0, 2048, (b, tokens.shape[1])) for b in (3, 5))):  # batch 2, 3, 5
        seen = len(commfuse_compile.reports())
        compiled(batch).float().sum().backward()
        new = commfuse_compile.reports()[seen:]
        report = merge_reports(new) if new else None
        reports.append(report)
        rewritten.append(Counter((s.graph, s.pattern) for s in report.rewritten) if report else None)
        # (the collective's tensor, the first shape recorded: a symbol is recorded by name)
        symbolic.append(report and all(any(isinstance(size, str) for size in next(iter(s.shapes.values()))) for s in report.rewritten))
    torch._dynamo.reset()
    _check_sites(reports[0], builder, expected)
    assert rewritten[0] == rewritten[1] and sum(rewritten[1].values()) == 18, rewritten
    assert symbolic[:2] == [False, True]  # batch 3: the same sites, planned with the batch a symbol
    assert rewritten[2] is None  # batch 5 reuses the symbolic graphs


def test_hf_gradient_checkpointing_still_needs_the_aot_workaround(world, monkeypatch):
    """Hugging Face's ``gradient_checkpointing_enable()`` under its TP plan does not compile on
    torch 2.13 without ``clients._aot_rng_states_before_opaque_objects`` under any backend
    (here ``aot_eager``, no commfuse involved). When this fails, torch compiles it as shipped:
    drop the workaround."""
    import torch._functorch.partitioners as partitioners

    model, (input_ids,) = BUILDERS["hf_llama"](WORLD, gradient_checkpointing=True)
    monkeypatch.setattr(partitioners, "functionalize_rng_ops", partitioners.functionalize_rng_ops.original)
    torch._dynamo.reset()
    with pytest.raises(AssertionError, match="expected all tensors_saved_with_vc_check to be Tensors.*DeviceMesh"):
        torch.compile(model, backend="aot_eager")(input_ids).sum().backward()
    torch._dynamo.reset()
