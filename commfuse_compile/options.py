"""User options of the ``commfuse`` backend: ``torch.compile(m, backend="commfuse", options={...})``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class CommfuseOptions:
    """Validated options. Every field can be set through ``options={...}``.

    Attributes:
        flash_ag: decompose all-gather → matmul into the Flash-AG ring.
        flash_rs: decompose matmul → reduce-scatter into the Flash-RS ring.
        pin_order: pin every ring step as start → matmul → wait in Inductor's generated code.
            Without it Inductor's peak-memory reordering may pull each wait up to its start,
            which keeps results exact but removes the overlap.
        strict: if the pass raises on a graph, re-raise instead of warning and compiling that
            graph unrewritten.
    """

    flash_ag: bool = True
    flash_rs: bool = True
    pin_order: bool = True
    strict: bool = False

    @classmethod
    def from_user(cls, options: Mapping[str, Any] | CommfuseOptions | None) -> CommfuseOptions:
        """Build options from what the user passed, raising a clear error for bad input."""
        if options is None:
            return cls()
        if isinstance(options, CommfuseOptions):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(
                f"commfuse options must be a dict, got {type(options).__name__}; "
                f"valid keys: {', '.join(cls.valid_keys())}"
            )
        unknown = sorted(set(options) - set(cls.valid_keys()))
        if unknown:
            raise ValueError(
                f"unknown commfuse option(s) {', '.join(map(repr, unknown))}; "
                f"valid keys: {', '.join(cls.valid_keys())}"
            )
        for key, value in options.items():
            if not isinstance(value, bool):
                raise ValueError(
                    f"commfuse option {key!r} must be True or False, got {value!r}"
                )
        return cls(**options)

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def cache_key(self) -> str:
        """A stable string covering every option (part of the Inductor cache key)."""
        return ";".join(f"{k}={getattr(self, k)!r}" for k in self.valid_keys())
