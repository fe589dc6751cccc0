"""User options of the ``commfuse`` backend: ``torch.compile(m, backend="commfuse", options={...})``,
or, where a framework hands ``torch.compile`` a backend name only (torchtitan's
``--compile.backend commfuse``), the environment variable ``COMMFUSE_OPTIONS`` holding a JSON
object of the same options. Both are read when a graph is compiled; a key given in
``options=`` overrides the same key of the variable."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

SCHEDULES = ("auto", "ring", "bidirectional", "slicing", "off")
PATTERN_KINDS = ("all_gather_matmul", "matmul_reduce_scatter", "all_to_all", "moe_ep")
# torch.compile's modes as Inductor defines them (torch._inductor.list_mode_options), less
# "lite": it turns Inductor's post-grad passes off, and the commfuse pass is one of them.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ENVIRONMENT_VARIABLE = "COMMFUSE_OPTIONS"


@dataclasses.dataclass(frozen=True)
class CommfuseOptions:
    """Validated options. Every field can be set through ``options={...}``.

    Attributes:
        schedule: how each all-gather → matmul / matmul → reduce-scatter is decomposed.
            ``"auto"``: the cost model picks per match among the others (or leaves it alone);
            ``"ring"``: the CommFuse ring; ``"bidirectional"``: the ring with half of each chunk
            travelling each way; ``"slicing"``: the data-slicing baseline (K sliced collectives,
            each overlapping the next slice's matmul); ``"off"``: match and record, rewrite nothing.
        chunks_per_rank: ring / bidirectional: each rank's chunk is cut into this many pieces
            (the paper's m). Slicing: the number of slices. ``None``: 1 for the rings, 4 for
            slicing, and for ``auto`` the cost model's choice.
        profile: the hardware the cost model assumes: a built-in name
            (:func:`commfuse_compile.profiles.names`), a dict of
            :class:`~commfuse_compile.profiles.HardwareProfile` fields, or ``None`` for the
            profile of the device the graph runs on.
        min_speedup: ``auto`` decomposes a match only if the estimated time of vanilla over
            that of the chosen schedule is at least this; a float for every pattern or a dict
            keyed by ``"all_gather_matmul"`` / ``"matmul_reduce_scatter"`` / ``"all_to_all"``
            (an all-reduce's halves use the first two).
        flash_ag: decompose all-gather → matmul at all.
        flash_rs: decompose matmul → reduce-scatter at all.
        flash_ar: split an all-reduce between matmuls into a reduce-scatter and an all-gather,
            each then decomposed as above (Flash-RS, Flash-AG) where its pattern allows.
        flash_a2a: decompose an all-to-all next to row-local compute into pairwise steps
            (Flash-All-to-All), and an expert-parallel MoE layer's dispatch, experts and
            combine into one pipeline over the source ranks (``moe_ep``).
        fusion: compute the row-local ops next to each ring inside its steps: after Flash-AG
            the elementwise ops, norms over the last dim and replicated-weight matmuls that
            follow; before Flash-RS the ops that produce its matmul's input, including
            query-split attention. Off: only the matmuls are cut.
        pin_order: pin every step as start → matmul → wait in Inductor's generated code.
            Without it Inductor's peak-memory reordering may pull each wait up to its start,
            which keeps results exact but removes the overlap.
        codegen: hand the rewritten graphs to Inductor's code generation. Off: they run op by
            op on ATen, as the ``aot_eager`` backend runs its graphs, after Inductor's post-grad
            passes up to and including the commfuse pass (the same rewrite, no kernel compiled;
            the passes after it only prepare code generation): to tell a problem of the
            rewrite from one of Inductor's, or to check numerics fast.
        strict: if the pass raises on a graph, re-raise instead of warning and compiling that
            graph unrewritten.
        mode: the torch.compile mode for Inductor (:data:`MODES`), applied as
            ``torch.compile(..., mode=...)`` applies it to Inductor. ``torch.compile`` refuses
            ``mode`` and ``options`` together, so with commfuse options give it here.
    """

    schedule: str = "auto"
    chunks_per_rank: int | None = None
    profile: str | Mapping[str, Any] | None = None
    min_speedup: float | Mapping[str, float] = 1.0
    flash_ag: bool = True
    flash_rs: bool = True
    flash_ar: bool = True
    flash_a2a: bool = True
    fusion: bool = True
    pin_order: bool = True
    codegen: bool = True
    strict: bool = False
    mode: str = "default"

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def from_user(cls, options: Mapping[str, Any] | CommfuseOptions | None, environment: bool = False) -> CommfuseOptions:
        """Build options from what the user passed, raising a clear error for bad input.

        ``environment``: start from the options in ``COMMFUSE_OPTIONS``
        (:func:`options_from_environment`), each key given in ``options`` overriding it."""
        if environment and (from_environment := options_from_environment()):
            merged = {**from_environment, **_as_mapping(options)}
            try:
                return cls.from_user(merged)
            except (TypeError, ValueError) as err:  # (each alone was valid: it is their mix)
                raise ValueError(f"{err} (options={dict(_as_mapping(options))!r} over {ENVIRONMENT_VARIABLE}={from_environment!r})") from None
        if options is None:
            return cls()
        if isinstance(options, CommfuseOptions):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(
                f"commfuse options must be a dict, got {type(options).__name__}; "
                f"valid keys: {', '.join(cls.valid_keys())}"
            )
        if "outline" in options:
            raise ValueError(
                "commfuse option 'outline' was removed: every ring step now reads its pieces through "
                "pointers of their own (commfuse.piece), so steps share their kernels without it; drop the option"
            )
        unknown = sorted(set(options) - set(cls.valid_keys()))
        if unknown:
            raise ValueError(
                f"unknown commfuse option(s) {', '.join(map(repr, unknown))}; "
                f"valid keys: {', '.join(cls.valid_keys())}"
            )
        for key in ("flash_ag", "flash_rs", "flash_ar", "flash_a2a", "fusion", "pin_order", "codegen", "strict"):
            if key in options and not isinstance(options[key], bool):
                raise ValueError(f"commfuse option {key!r} must be True or False, got {options[key]!r}")
        return cls(**options)

    def _check(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"commfuse option 'schedule' must be one of {', '.join(map(repr, SCHEDULES))}, got {self.schedule!r}")
        m = self.chunks_per_rank
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"commfuse option 'chunks_per_rank' must be an int >= 1 or None, got {m!r}")
        if self.schedule == "off" and m is not None:
            raise ValueError("commfuse option 'chunks_per_rank' has no effect with schedule='off'; drop one of them")
        speedups = self.min_speedup if isinstance(self.min_speedup, Mapping) else {k: self.min_speedup for k in PATTERN_KINDS}
        unknown = sorted(set(speedups) - set(PATTERN_KINDS))
        if unknown:
            raise ValueError(f"commfuse option 'min_speedup': unknown pattern(s) {unknown}; valid: {', '.join(PATTERN_KINDS)}")
        for kind, value in speedups.items():
            if not is_positive_number(value):
                raise ValueError(f"commfuse option 'min_speedup' for {kind} must be a finite number > 0, got {value!r}")
        if self.mode not in MODES:
            lite = " ('lite' turns off Inductor's post-grad passes, where commfuse runs)" if self.mode == "lite" else ""
            raise ValueError(f"commfuse option 'mode' must be one of {', '.join(map(repr, MODES))}, got {self.mode!r}{lite}")
        from .profiles import resolve_profile

        if self.profile is not None:
            resolve_profile(self.profile)  # raises naming the option and the valid names / fields

    def min_speedup_for(self, kind: str) -> float:
        """The ``min_speedup`` threshold of pattern ``kind`` (one of :data:`PATTERN_KINDS`)."""
        if isinstance(self.min_speedup, Mapping):
            return float(self.min_speedup.get(kind, 1.0))
        return float(self.min_speedup)

    def inductor_config(self) -> dict[str, Any]:
        """The Inductor config patches of ``mode``, as torch.compile applies them to Inductor."""
        from torch._inductor import list_mode_options

        return dict(list_mode_options(self.mode))

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.valid_keys()}

    def cache_key(self) -> str:
        """A stable string covering every option (part of the Inductor cache key)."""
        return json.dumps(self.as_dict(), sort_keys=True, default=repr)


def options_from_environment() -> dict[str, Any]:
    """The options in the environment variable ``COMMFUSE_OPTIONS`` (a JSON object; ``{}`` when
    it is unset or empty), validated as ``options=`` is: an error names the variable and the key."""
    import os

    text = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{ENVIRONMENT_VARIABLE} is not valid JSON ({err}): {text!r}; give a JSON object such as '{{\"schedule\": \"ring\"}}'") from None
    if not isinstance(options, dict):
        raise ValueError(f"{ENVIRONMENT_VARIABLE} must hold a JSON object of commfuse options, got {text!r}; for example '{{\"schedule\": \"ring\"}}'")
    try:
        CommfuseOptions.from_user(options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={text!r}: {err}") from None
    return options


def _as_mapping(options: Mapping[str, Any] | CommfuseOptions | None) -> Mapping[str, Any]:
    if options is None:
        return {}
    if isinstance(options, CommfuseOptions):
        return options.as_dict()
    if not isinstance(options, Mapping):  # (from_user names the type error)
        CommfuseOptions.from_user(options)
    return options


def is_positive_number(value: Any) -> bool:
    """A finite int or float > 0 (not a bool: ``True`` is an int to Python, not a number here)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
