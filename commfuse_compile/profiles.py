"""Named hardware profiles: what the cost model assumes about compute and links.

A profile is a handful of numbers (see :class:`HardwareProfile`). The GPU profiles take their
peak FLOP/s and link bandwidths from public datasheets (dense, without sparsity; NVLink totals
halved to get one direction); their latency, efficiency-curve and interference figures are
round assumptions, named as such. ``cpu-gloo`` was measured on the machine this project is
developed on by ``benchmarks/calibrate_cpu_profile.py`` (its output is quoted there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from .options import is_positive_number


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """What one rank's compute and its links to the ring neighbours can do.

    Attributes:
        name: profile name.
        source: where the numbers come from.
        flops_16bit: peak dense matmul FLOP/s in bf16 / fp16.
        flops_32bit: peak dense matmul FLOP/s in fp32.
        half_efficiency_dim: a matmul whose smallest dim is this runs at half of peak; the
            efficiency is ``d / (d + half_efficiency_dim)`` for smallest dim ``d`` (small chunks
            run below peak, which is what makes very fine slicing lose).
        matmul_overhead: seconds of fixed cost per matmul (launch, dispatch).
        link_bandwidth: bytes/s in one direction between ring neighbours.
        link_latency: seconds of fixed cost per message.
        duplex: the links to the two neighbours carry traffic at the same time (a
            bidirectional ring needs it to gain anything).
        collective_latency: seconds of fixed cost per step of the plain collective (the
            library's own all-gather / reduce-scatter), where it differs from a ring step's
            ``link_latency`` (``None``: the same).
        overlap_slowdown: compute that runs while transfers are in flight takes this factor
            longer (shared memory bandwidth / SMs on GPUs, shared cores for gloo); the
            transfers themselves run at the link's rate (a link, not the compute, bounds them).
        step_overhead: seconds each point-to-point step takes from the compute beside it,
            which no overlap hides: issuing and finishing the transfer (0: none assumed;
            where ``auto`` measures, a matmul with a small exchange in flight minus the longer
            of the two alone).
    """

    name: str
    source: str
    flops_16bit: float
    flops_32bit: float
    half_efficiency_dim: float
    matmul_overhead: float
    link_bandwidth: float
    link_latency: float
    duplex: bool = True
    overlap_slowdown: float = 1.0
    collective_latency: float | None = None
    step_overhead: float = 0.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_field(field.name, getattr(self, field.name))

    def peak_flops(self, dtype: torch.dtype) -> float:
        return self.flops_16bit if dtype in (torch.bfloat16, torch.float16) else self.flops_32bit

    def matmul_seconds(self, m: int, k: int, n: int, dtype: torch.dtype) -> float:
        """Modelled time of one ``[m, k] @ [k, n]`` matmul."""
        smallest = max(min(m, k, n), 1)
        efficiency = smallest / (smallest + self.half_efficiency_dim)
        return self.matmul_overhead + 2.0 * m * k * n / (self.peak_flops(dtype) * efficiency)

    def transfer_seconds(self, nbytes: float) -> float:
        """Modelled time of one point-to-point message of ``nbytes`` to a neighbour."""
        return self.link_latency + nbytes / self.link_bandwidth

    def collective_step_seconds(self, nbytes: float) -> float:
        """Modelled time of one step (``nbytes`` to a neighbour) of the plain collective."""
        latency = self.link_latency if self.collective_latency is None else self.collective_latency
        return latency + nbytes / self.link_bandwidth


# Fields that may be 0 (an idealised profile: no latency, no per-matmul cost, full efficiency
# at any size); every other number must be > 0, and overlap_slowdown >= 1.
ZERO_ALLOWED = ("link_latency", "matmul_overhead", "half_efficiency_dim", "collective_latency", "step_overhead")


def _check_field(key: str, value: Any) -> None:
    """Raise ``ValueError`` naming the field unless ``value`` is valid for it."""
    if key in ("name", "source"):
        if not isinstance(value, str):
            raise ValueError(f"commfuse option 'profile': field {key!r} must be a string, got {value!r}")
        return
    if key == "collective_latency" and value is None:
        return
    if key == "duplex":
        if not isinstance(value, bool):  # ("no" would read as True)
            raise ValueError(f"commfuse option 'profile': field 'duplex' must be True or False, got {value!r}")
        return
    zero_ok = key in ZERO_ALLOWED and not isinstance(value, bool) and value == 0
    if not (is_positive_number(value) or zero_ok) or (key == "overlap_slowdown" and value < 1):
        floor = ">= 0" if key in ZERO_ALLOWED else ">= 1" if key == "overlap_slowdown" else "> 0"
        raise ValueError(f"commfuse option 'profile': field {key!r} must be a finite number {floor}, got {value!r}")


_ASSUMED = "latency, efficiency curve and overlap slowdown are assumptions, not measurements"

BUILTIN: dict[str, HardwareProfile] = {
    p.name: p
    for p in [
        HardwareProfile(
            name="h100-nvlink",
            source="NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32; "
            f"NVLink 4 900 GB/s total = 450 GB/s per direction; {_ASSUMED}",
            flops_16bit=989e12,
            flops_32bit=67e12,
            half_efficiency_dim=256,
            matmul_overhead=5e-6,
            link_bandwidth=450e9,
            link_latency=8e-6,
            overlap_slowdown=1.1,
        ),
        HardwareProfile(
            name="a100-nvlink",
            source="NVIDIA A100 SXM datasheet: 312 TFLOP/s dense bf16, 19.5 TFLOP/s fp32; "
            f"NVLink 3 600 GB/s total = 300 GB/s per direction; {_ASSUMED}",
            flops_16bit=312e12,
            flops_32bit=19.5e12,
            half_efficiency_dim=192,
            matmul_overhead=5e-6,
            link_bandwidth=300e9,
            link_latency=10e-6,
            overlap_slowdown=1.1,
        ),
        HardwareProfile(
            name="l40s-pcie",
            source="NVIDIA L40S datasheet: 362 TFLOP/s dense bf16, 91.6 TFLOP/s fp32; "
            f"PCIe Gen4 x16 about 32 GB/s per direction, no NVLink; {_ASSUMED}",
            flops_16bit=362e12,
            flops_32bit=91.6e12,
            half_efficiency_dim=192,
            matmul_overhead=5e-6,
            link_bandwidth=32e9,
            link_latency=20e-6,
            overlap_slowdown=1.05,
        ),
        HardwareProfile(
            name="cpu-gloo",
            source="measured by benchmarks/calibrate_cpu_profile.py on the 2-core development "
            "machine, 2026-11-30: 1 thread per rank, gloo over loopback (medians)",
            flops_16bit=176e9,
            flops_32bit=83e9,
            half_efficiency_dim=5,
            matmul_overhead=1.2e-6,
            link_bandwidth=2.65e9,
            link_latency=64e-6,
            duplex=True,
            overlap_slowdown=1.0,
        ),
    ]
}

DEVICE_DEFAULTS = {"cpu": "cpu-gloo", "cuda": "h100-nvlink"}


def names() -> list[str]:
    """The built-in profile names."""
    return sorted(BUILTIN)


def resolve_profile(profile: str | Mapping[str, Any] | HardwareProfile | None, device: str = "cpu") -> HardwareProfile:
    """The profile named / described by the ``profile`` option (``None``: the device's default).

    A dict may name a built-in ``"base"`` profile and override some of its fields, or give
    every field. Errors name the option, the valid names and the valid fields.
    """
    if isinstance(profile, HardwareProfile):
        return profile
    if profile is None:
        return BUILTIN[DEVICE_DEFAULTS.get(device, "h100-nvlink")]
    if isinstance(profile, str):
        if profile not in BUILTIN:
            raise ValueError(f"commfuse option 'profile': unknown profile {profile!r}; built-in: {', '.join(names())}")
        return BUILTIN[profile]
    if not isinstance(profile, Mapping):
        raise ValueError(f"commfuse option 'profile' must be a profile name or a dict, got {type(profile).__name__}")
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    values = dict(profile)
    base = values.pop("base", None)
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"commfuse option 'profile': unknown field(s) {unknown}; valid: base, {', '.join(sorted(fields))}")
    if base is not None:
        if not isinstance(base, str):
            raise ValueError(f"commfuse option 'profile': 'base' must be a built-in profile name ({', '.join(names())}), got {base!r}")
        return dataclasses.replace(resolve_profile(base), **{"name": f"{base}+custom", **values})
    missing = sorted(fields - set(values) - {"source", "duplex", "overlap_slowdown", "name", "collective_latency", "step_overhead"})
    if missing:
        raise ValueError(f"commfuse option 'profile': missing field(s) {missing} (or give 'base': a built-in name)")
    values.setdefault("name", "custom")
    values.setdefault("source", "given in options")
    return HardwareProfile(**values)
