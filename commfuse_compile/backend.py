"""The ``commfuse`` torch.compile backend.

``torch.compile(model, backend="commfuse", options={...})`` resolves here through the
``torch_dynamo_backends`` entry point. The backend hands the graph to Inductor unchanged and
installs the commfuse pipeline as Inductor's ``post_grad_custom_post_pass``, so it runs on the
post-grad forward and backward graphs, where the functional collectives (including those of
DTensor) are visible as aten ops.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from ._compat import CustomInferenceAwareGraphPass, get_hash_for_files
from .options import ENVIRONMENT_VARIABLE, CommfuseOptions, options_from_environment
from .report import Report, new_report

log = logging.getLogger("commfuse_compile")

__all__ = ["CommfusePass", "commfuse"]


class CommfusePass(CustomInferenceAwareGraphPass):
    """Inductor post-grad pass running match → plan → rewrite → order → check → report.

    Cache-safe: ``uuid()`` covers the package's source, the options, this process's rank and
    the layout of every process group it belongs to (name, its index there, the members). The
    rewritten graph bakes in the rank's index within the group and its ring peers, and group
    names are counters (``new_group`` calls), so the same name can mean other members in
    another run: such code must never be served from a shared Inductor cache.
    """

    def __init__(self, options: CommfuseOptions, report: Report):
        self.options = options
        self.report = report

    def __call__(self, graph: torch.fx.Graph, is_inference: bool) -> None:
        from commfuse_compile.passes import graph_kind, run_pipeline
        from commfuse_compile.passes.blame import describe_error

        from .explain import PostGradDone, stops_here

        kind = graph_kind(graph, is_inference)
        self.report.graph_kinds.append(kind)
        started = time.perf_counter()
        try:
            run_pipeline(graph, self.options, kind, self.report)
            self.report.add_graph(kind, graph)
        except Exception as err:
            if self.options.strict:
                raise
            message = (
                f"commfuse: the pass failed on the {kind} graph, which is compiled unrewritten "
                f"({describe_error(err)}); options={{'strict': True}} raises instead"
            )
            log.warning(message)
            self.report.errors.append(message)
        finally:
            self.report.pass_seconds += time.perf_counter() - started
        if stops_here(graph):  # (op by op: nothing after this pass is needed)
            raise PostGradDone

    def uuid(self) -> str:
        key = f"{self.options.cache_key()};{group_layout()};torch={torch.__version__}"
        return hashlib.sha256(_source_hash() + key.encode()).hexdigest()


def group_layout() -> str:
    """This rank and every process group it belongs to: the group's name, this rank's index in
    it and its members (global ranks, in group order) — what the emitted rings depend on."""
    if not dist.is_initialized():
        return "rank=-"
    from torch.distributed.distributed_c10d import _world

    me = dist.get_rank()
    groups = []
    for group, ranks in _world.pg_group_ranks.items():
        if me in ranks:
            members = sorted(ranks, key=ranks.__getitem__)
            groups.append(f"{_world.pg_names.get(group)}:{ranks[me]}:{members}")
    return f"rank={me}/{dist.get_world_size()};groups=" + ";".join(sorted(groups))


@functools.cache
def _source_hash() -> bytes:
    """Hash of every source file of the package, passes included (they install elsewhere)."""
    import commfuse_compile.passes as passes

    roots = {pathlib.Path(__file__).parent, pathlib.Path(passes.__file__).parent}
    files = sorted(str(p) for root in roots for p in root.rglob("*.py"))
    return get_hash_for_files(tuple(files))


def commfuse(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
    _inner_compile: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """Compile ``gm`` with Inductor, rewriting collectives + matmuls into CommFuse rings.

    Args:
        gm: the Dynamo graph.
        example_inputs: its example inputs.
        options: see :class:`~commfuse_compile.options.CommfuseOptions`; unknown keys or bad
            values raise ``ValueError`` naming the valid keys. Each key overrides the same key
            of the environment variable ``COMMFUSE_OPTIONS`` (a JSON object of options, read
            here, on every compile: the way to set options where a framework passes the
            backend's name only).
        mode: ``torch.compile(..., mode=...)``: Inductor's options of that mode are applied
            (``"reduce-overhead"``: CUDA graphs; ``"max-autotune"``: autotuned kernels and CUDA
            graphs; ``"max-autotune-no-cudagraphs"``). torch.compile passes ``mode`` or
            ``options``, never both: with commfuse options, give ``options={"mode": ...}``.
        _inner_compile: Inductor's per-graph compile to use instead of its own (``explain``
            plans without generating code this way; never with a cache).
    """
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from .explain import run_rewritten

    opts = _with_measured_profile(CommfuseOptions.from_user(_with_mode(options, mode), environment=True))
    report = new_report({k: getattr(opts, k) for k in opts.valid_keys()})
    if from_environment := options_from_environment():
        log.info("commfuse compile %d: options from %s: %s", report.compile_id, ENVIRONMENT_VARIABLE, from_environment)
    hits_before = _cache_hits()
    compiled = compile_fx(
        gm,
        example_inputs,
        inner_compile=_inner_compile or (compile_fx_inner if opts.codegen else run_rewritten),
        config_patches={**opts.inductor_config(), "post_grad_custom_post_pass": CommfusePass(opts, report)},
    )
    report.cache_hits = _cache_hits() - hits_before
    if report.cache_hits:
        log.info(
            "commfuse compile %d: %d graph(s) served from Inductor's FX graph cache; their rewrite "
            "is in the cached code, so the pass did not run and recorded nothing for them",
            report.compile_id,
            report.cache_hits,
        )
    if not report.rewritten and not report.cache_hits and not report.errors:  # (errors: warned already)
        reasons = "; ".join(sorted({s.reason for s in report.skipped})) or (
            "no all-gather, reduce-scatter or all-reduce in the graph (collectives issued outside compiled "
            "graphs, e.g. by FSDP2's hooks, never reach commfuse)"
        )
        log.warning(
            "commfuse rewrote nothing in compile %d (graphs %s): %s",
            report.compile_id,
            report.graph_kinds,
            reasons,
        )
    return compiled


def _with_measured_profile(opts: CommfuseOptions) -> CommfuseOptions:
    """``auto`` with no ``profile`` on a real process group plans with what the group measured
    (:mod:`commfuse_compile.calibrate`: at this process's first compile, every rank at once,
    or from the disk cache), given as the ``profile`` option so the cache key covers it."""
    if opts.schedule != "auto" or opts.profile is not None:
        return opts
    from .calibrate import as_option, measured_profile

    profile = measured_profile()
    return opts if profile is None else dataclasses.replace(opts, profile=as_option(profile))


def _with_mode(options: Mapping[str, Any] | CommfuseOptions | None, mode: str | None) -> Any:
    """``options`` with torch.compile's ``mode`` folded in (refusing two different modes)."""
    if mode is None:
        return options
    if isinstance(options, CommfuseOptions):
        options = options.as_dict()
    if options is not None and not isinstance(options, Mapping):
        return options  # from_user names the type error
    merged = dict(options or {})
    if merged.setdefault("mode", mode) != mode:
        raise ValueError(f"commfuse: mode={mode!r} and options={{'mode': {merged['mode']!r}}} disagree; give one of them")
    return merged


def _cache_hits() -> int:
    # AOTAutograd cache hits load their graphs through the FX graph cache: count those only.
    return counters["inductor"]["fxgraph_cache_hit"]
