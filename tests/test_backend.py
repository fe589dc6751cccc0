"""Backend plumbing, single process: entry point, options, cache safety, fallback and strict mode."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from conftest import fake_world
from torch._inductor.utils import run_and_get_code

import commfuse_compile
import commfuse_compile.backend as backend_module
from commfuse_compile._compat import _missing
from commfuse_compile.backend import CommfusePass
from commfuse_compile.options import CommfuseOptions
from commfuse_compile.report import new_report


@pytest.fixture(scope="module")
def world():
    with fake_world(2, rank=1) as group:
        yield group


def gather_matmul(group):
    def f(x, w):
        return funcol.all_gather_tensor(x, 0, group) @ w

    return f


def compiled_code(fn, backend, *inputs, **kwargs) -> str:
    torch._dynamo.reset()
    if backend == "commfuse":  # the toy sizes: name the schedule, auto would leave them alone
        kwargs["options"] = {"schedule": "ring", **kwargs.get("options", {})}
    _, code = run_and_get_code(torch.compile(fn, backend=backend, **kwargs), *inputs)
    return "\n".join(code)


def test_backend_is_registered_by_entry_point_only():
    (ep,) = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "commfuse"]
    assert ep.value == "commfuse_compile.backend:commfuse"
    assert ep.load() is backend_module.commfuse
    # Dynamo resolves the name through the entry point.
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("commfuse") is backend_module.commfuse


def test_unknown_option_names_the_valid_keys():
    with pytest.raises(ValueError, match="unknown commfuse option.*'chunks'.*valid keys: schedule, chunks_per_rank, profile, min_speedup, flash_ag"):
        CommfuseOptions.from_user({"chunks": 2})


def test_bad_option_value_and_type():
    with pytest.raises(ValueError, match="'strict' must be True or False, got 'yes'"):
        CommfuseOptions.from_user({"strict": "yes"})
    with pytest.raises(TypeError, match="must be a dict.*valid keys"):
        CommfuseOptions.from_user(["strict"])


def test_bad_option_fails_the_compile(world):
    with pytest.raises(Exception, match="unknown commfuse option"):
        compiled_code(gather_matmul(world), "commfuse", torch.randn(4, 8), torch.randn(8, 4), options={"bogus": 1})


def test_cache_key_covers_options_rank_and_source(monkeypatch):
    monkeypatch.setattr(backend_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(backend_module.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(backend_module.dist, "get_world_size", lambda: 2)
    report = new_report({})
    key = CommfusePass(CommfuseOptions(), report).uuid()
    assert key == CommfusePass(CommfuseOptions(), report).uuid()
    assert key != CommfusePass(CommfuseOptions(flash_rs=False), report).uuid()
    assert key != CommfusePass(CommfuseOptions(pin_order=False), report).uuid()
    # The rewritten graph bakes in the rank: rank 1 must never get rank 0's compiled code.
    monkeypatch.setattr(backend_module.dist, "get_rank", lambda: 1)
    assert key != CommfusePass(CommfuseOptions(), report).uuid()
    # The package's source is part of the key.
    monkeypatch.setattr(backend_module, "_source_hash", lambda: b"edited source")
    assert CommfusePass(CommfuseOptions(), report).uuid() != key


def test_warm_inductor_cache_never_serves_unrewritten_code(world):
    f, inputs = gather_matmul(world), (torch.randn(4, 8), torch.randn(8, 4))
    assert "ring_exchange" not in compiled_code(f, "inductor", *inputs)  # warms the cache
    assert "ring_exchange" in compiled_code(f, "commfuse", *inputs)
    assert commfuse_compile.last_report().rewritten
    # Warm for both now: each is served its own code.
    assert "ring_exchange" in compiled_code(f, "commfuse", *inputs)
    assert commfuse_compile.last_report().cache_hits >= 1
    assert "ring_exchange" not in compiled_code(f, "inductor", *inputs)
    # Other options: another cache entry, rewritten per those options.
    assert "ring_exchange" not in compiled_code(f, "commfuse", *inputs, options={"flash_ag": False})


def _failing_rewrite(*args, **kwargs):
    raise RuntimeError("injected rewrite failure")


def test_pass_failure_warns_and_compiles_unrewritten(world, monkeypatch, caplog):
    import commfuse_compile.passes as passes

    monkeypatch.setattr(passes, "rewrite_site", _failing_rewrite)
    # Shapes no other test compiles: a cache hit would skip the pass (and the injected failure).
    f, x, w = gather_matmul(world), torch.randn(4, 6), torch.randn(6, 4)
    with caplog.at_level(logging.WARNING, logger="commfuse_compile"):
        code = compiled_code(f, "commfuse", x, w)
    assert "ring_exchange" not in code and "all_gather_into_tensor" in code
    report = commfuse_compile.last_report()
    assert report.errors and "injected rewrite failure" in report.errors[0]
    assert any("compiled unrewritten" in r.getMessage() for r in caplog.records)


def test_pass_failure_raises_in_strict_mode(world, monkeypatch):
    import commfuse_compile.passes as passes

    monkeypatch.setattr(passes, "rewrite_site", _failing_rewrite)
    with pytest.raises(Exception, match="injected rewrite failure"):
        compiled_code(gather_matmul(world), "commfuse", torch.randn(4, 5), torch.randn(5, 4), options={"strict": True})


def test_missing_private_api_names_torch_version():
    message = str(_missing("torch._inductor.some_api", ImportError("gone")))
    assert torch.__version__ in message and "torch._inductor.some_api" in message and "2.13" in message
