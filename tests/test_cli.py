"""``python -m commfuse_compile explain | simulate | bench | calibrate`` (the demo has its own test)."""

from __future__ import annotations

import json
import textwrap

import pytest

from commfuse_compile.__main__ import main

BUILDER = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def mlp(x, w1, w2):
        h = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
        return funcol.reduce_scatter_tensor(torch.relu(h @ w1) @ w2, "sum", 0, dist.group.WORLD)

    def build(world_size):
        return mlp, [torch.randn(4, 16, requires_grad=True), torch.randn(16, 32), torch.randn(32, 16)]
    """
)


@pytest.mark.parametrize("command", ["demo", "explain", "simulate", "bench", "calibrate"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0 and "usage" in capsys.readouterr().out


def test_explain_a_file(tmp_path, capsys):
    source = tmp_path / "model.py"
    source.write_text(BUILDER)
    trace = tmp_path / "trace.json"
    code = main(["explain", str(source), "build", "--world-size", "4", "--options", '{"schedule": "ring"}', "--trace", str(trace)])
    out = capsys.readouterr().out
    assert code == 0 and "4 rewritten, 0 skipped" in out, out
    assert "traceEvents" in json.loads(trace.read_text())


def test_explain_names_a_missing_function(tmp_path):
    source = tmp_path / "model.py"
    source.write_text(BUILDER)
    with pytest.raises(SystemExit, match="no function 'nope'"):
        main(["explain", str(source), "nope"])


def test_simulate_prints_every_schedule_and_autos_choice(capsys):
    assert main(["simulate", "-M", "4096", "-K", "1024", "-N", "4096", "--group-size", "4", "--profile", "l40s-pcie"]) == 0
    out = capsys.readouterr().out
    for label in ("vanilla", "ring(m=1)", "bidirectional(m=1)", "slicing(m=4)"):
        assert f"\n{label} " in out, out
    assert "auto: " in out


def test_bench_runs_the_paper_check(capsys):
    assert main(["bench", "paper"]) == 0
    assert "Table 1" in capsys.readouterr().out


@pytest.mark.slow
def test_calibrate_measures_and_caches(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("COMMFUSE_CACHE_DIR", str(tmp_path))
    assert main(["calibrate", "--world-size", "2"]) == 0
    out = capfd.readouterr().out
    assert "measured(2 ranks), measured at the first compile" in out and "MB/s per direction" in out, out
    (cached,) = tmp_path.glob("profile-*.json")
    assert set(json.loads(cached.read_text())["values"]) >= {"link_bandwidth", "link_latency", "flops_32bit"}


def test_calibrate_needs_two_ranks(capsys):
    assert main(["calibrate", "--world-size", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err
