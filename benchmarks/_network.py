"""The benchmarks' network: loopback in a private network namespace, shaped by a token bucket.

Plain loopback gloo costs CPU, not wall time: on 2 cores a transfer competes with the matmuls
and overlap cannot show. So when ``unshare -n`` works (root) a benchmark re-executes itself in
a private network namespace whose loopback is shaped by a token bucket (``tc qdisc replace dev
lo root tbf rate RATE burst 512kb latency 100ms``, shared by all ranks): communication then
takes wall time at a few % CPU. The ranks are children of the re-executed script, so they share
its namespace, and :func:`shape_loopback` may change the rate while they run.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from typing import Any

from _common import progress, script_command

# Set in the re-executed child that runs inside the private network namespace.
NETNS_ENV = "COMMFUSE_BENCH_NETNS"


def enter_network(script: str, argv: Sequence[str], shape: bool, rate: str) -> dict[str, Any] | int:
    """Where ``script`` runs with ``argv``: outside the namespace (and able to make one), run it
    again inside one and return its exit status; inside, shape loopback to ``rate`` and return
    the network's description; with ``shape`` False or no ``unshare``, plain loopback."""
    if not shape:
        return {"shaped": False, "note": "--no-shape: plain loopback, communication competes with compute for CPU"}
    if NETNS_ENV not in os.environ:
        if _can_unshare():
            progress("re-running inside a private network namespace (unshare -n)")
            # The child finds _common through its own directory, not through our sys.path.
            return subprocess.run(["unshare", "-n", *script_command(script, list(argv))], env={**os.environ, NETNS_ENV: "1"}).returncode
        return {"shaped": False, "note": "unshare -n failed (not root?): plain loopback, communication competes with compute for CPU"}
    up = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if up.returncode != 0:
        raise SystemExit(f"cannot bring up loopback in the network namespace: {up.stderr.strip()}")
    return shape_loopback(rate)


def shape_loopback(rate: str) -> dict[str, Any]:
    """Put (or replace) the token-bucket qdisc on this namespace's loopback at ``rate``."""
    tbf = ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, "burst", "512kb", "latency", "100ms"]
    shaped = subprocess.run(tbf, capture_output=True, text=True)
    if shaped.returncode != 0:
        return {"shaped": False, "note": f"tc failed ({shaped.stderr.strip()}): plain loopback in a private namespace"}
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout.strip()
    return {"shaped": True, "rate": rate, "note": f"private network namespace, {shown}"}


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


def rate_bytes_per_second(rate: str) -> float:
    """A tc rate ("400mbit", "1gbit", "50mbps", "1000000") in bytes per second."""
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "bit": 1 / 8, "bps": 1.0}
    text = rate.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text) / 8  # tc reads a bare number as bits per second
