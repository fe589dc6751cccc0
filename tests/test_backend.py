"""Backend plumbing, single process: entry point, options, cache safety, fallback and strict mode."""

from __future__ import annotations

import json
import logging
from importlib.metadata import entry_points

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from conftest import fake_world
from graphs import post_grad_graphs, rewrite_as
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


def gather_matmul_scatter(group):
    """Two sites: an all-gather → matmul and a matmul → reduce-scatter."""

    def f(x, w1, w2):
        return funcol.reduce_scatter_tensor(funcol.all_gather_tensor(x, 0, group) @ w1 @ w2, "sum", 0, group)

    return f


def _fail_on(pattern: str, stage_function):
    """``stage_function`` raising for the sites of ``pattern`` only."""

    def failing(graph_or_site, *args, **kwargs):
        site = next(a for a in (graph_or_site, *args) if hasattr(a, "pattern"))
        if site.pattern == pattern and site.decision != "skip":
            raise AssertionError()  # (no message: the record must still say what failed)
        return stage_function(graph_or_site, *args, **kwargs)

    return failing


@pytest.mark.parametrize("stage", ["planning", "emitting"])
def test_a_site_failure_costs_that_site_only(world, monkeypatch, caplog, stage):
    import commfuse_compile.passes as passes

    name = {"planning": "plan_site", "emitting": "rewrite_site"}[stage]
    monkeypatch.setattr(passes, name, _fail_on("matmul_reduce_scatter", getattr(passes, name)))
    inner = {"planning": 10, "emitting": 12}[stage]  # (shapes no other test compiles: no cache hit)
    inputs = torch.randn(4, inner), torch.randn(inner, 8), torch.randn(8, 4)
    with caplog.at_level(logging.WARNING, logger="commfuse_compile"):
        code = compiled_code(gather_matmul_scatter(world), "commfuse", *inputs)
    report = commfuse_compile.last_report()
    assert [s.pattern for s in report.rewritten] == ["all_gather_matmul"]
    (skipped,) = report.skipped
    assert skipped.pattern == "matmul_reduce_scatter"
    assert f"the pass failed while {stage} this site (AssertionError with no message, raised at test_backend.py:" in skipped.reason
    assert "ring_exchange" in code and "reduce_scatter_tensor" in code
    (error,) = report.errors
    assert "reduce_scatter_tensor" in error and stage in error
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1 site(s) of the inference graph" in warnings[0] and "reduce_scatter_tensor" in warnings[0], warnings


def test_a_site_failure_raises_in_strict_mode(world, monkeypatch):
    import commfuse_compile.passes as passes

    monkeypatch.setattr(passes, "rewrite_site", _failing_rewrite)
    with pytest.raises(Exception, match="all_gather_into_tensor.*injected rewrite failure"):
        compiled_code(gather_matmul(world), "commfuse", torch.randn(4, 5), torch.randn(5, 4), options={"strict": True})


def test_a_graph_failure_warns_once_and_compiles_unrewritten(world, monkeypatch, caplog):
    """A failure outside any one site's part (here a stage over all sites) costs the graph."""
    import commfuse_compile.passes as passes

    monkeypatch.setattr(passes, "separate_pieces", _failing_rewrite)
    f, x, w = gather_matmul(world), torch.randn(4, 6), torch.randn(6, 4)
    with caplog.at_level(logging.WARNING, logger="commfuse_compile"):
        code = compiled_code(f, "commfuse", x, w)
    assert "ring_exchange" not in code and "all_gather_into_tensor" in code
    report = commfuse_compile.last_report()
    assert report.errors and "injected rewrite failure" in report.errors[0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "compiled unrewritten" in warnings[0], warnings


def test_environment_options_merge_under_explicit_ones(world, monkeypatch):
    from commfuse_compile.options import ENVIRONMENT_VARIABLE

    monkeypatch.setenv(ENVIRONMENT_VARIABLE, '{"schedule": "bidirectional", "chunks_per_rank": 2}')
    merged = CommfuseOptions.from_user({"chunks_per_rank": 1}, environment=True)
    assert (merged.schedule, merged.chunks_per_rank) == ("bidirectional", 1)
    assert CommfuseOptions.from_user({"chunks_per_rank": 1}).schedule == "auto"  # (only where asked)
    # Read when a graph is compiled, by the backend and by explain alike.
    f, inputs = gather_matmul(world), (torch.randn(4, 9), torch.randn(9, 4))
    torch._dynamo.reset()
    torch.compile(f, backend="commfuse")(*inputs)
    report = commfuse_compile.last_report()
    assert report.options["schedule"] == "bidirectional" and report.options["chunks_per_rank"] == 2
    assert {s.schedule for s in report.rewritten} == {"bidirectional"}
    torch._dynamo.reset()
    torch.compile(f, backend="commfuse", options={"schedule": "ring"})(*inputs)
    assert {s.schedule for s in commfuse_compile.last_report().rewritten} == {"ring"}


def test_environment_options_are_in_the_cache_key_and_plan_check(world, monkeypatch):
    from commfuse_compile.options import ENVIRONMENT_VARIABLE

    def key() -> str:
        return CommfusePass(CommfuseOptions.from_user(None, environment=True), new_report({})).uuid()

    plain = key()
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, '{"schedule": "ring"}')
    assert key() != plain
    # The plan check compares the options the graph was planned with: the merged ones.
    graph = post_grad_graphs(gather_matmul(world), torch.randn(4, 8), torch.randn(8, 4), backward=False)["inference"]
    options = CommfuseOptions.from_user({"chunks_per_rank": 2}, environment=True)
    rewritten, _, _ = rewrite_as(graph, 1, "inference", **options.as_dict())
    (check,) = [n for n in rewritten.nodes if "check_plan" in str(n.target)]
    planned = json.loads(check.args[0])["options"]
    assert (planned["schedule"], planned["chunks_per_rank"]) == ("ring", 2)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "COMMFUSE_OPTIONS is not valid JSON"),
        ('["ring"]', "COMMFUSE_OPTIONS must hold a JSON object"),
        ('{"chunks": 2}', "COMMFUSE_OPTIONS='\\{\"chunks\": 2\\}': unknown commfuse option.*'chunks'"),
        ('{"strict": "yes"}', "COMMFUSE_OPTIONS=.*'strict' must be True or False"),
    ],
)
def test_bad_environment_options_name_the_variable_and_key(world, monkeypatch, text, message):
    from commfuse_compile.options import ENVIRONMENT_VARIABLE

    monkeypatch.setenv(ENVIRONMENT_VARIABLE, text)
    with pytest.raises(ValueError, match=message):
        CommfuseOptions.from_user(None, environment=True)
    with pytest.raises(Exception, match=message):  # (the compile fails, as for options=)
        compiled_code(gather_matmul(world), "commfuse", torch.randn(4, 8), torch.randn(8, 4))


def test_explicit_option_mixed_badly_with_the_environment_names_both(monkeypatch):
    from commfuse_compile.options import ENVIRONMENT_VARIABLE

    monkeypatch.setenv(ENVIRONMENT_VARIABLE, '{"chunks_per_rank": 2}')
    with pytest.raises(ValueError, match="'chunks_per_rank' has no effect with schedule='off'.*options=\\{'schedule': 'off'\\} over COMMFUSE_OPTIONS=\\{'chunks_per_rank': 2\\}"):
        CommfuseOptions.from_user({"schedule": "off"}, environment=True)


def test_op_by_op_stops_after_the_pass(world, monkeypatch):
    """``codegen=False`` runs Inductor's post-grad passes up to and including commfuse's, not
    the code-generation preparation after it (Inductor's fake-tensor refresh, which would
    propagate every rewritten node a second time); code generation still runs them."""
    from torch._inductor import fx_utils

    refreshed = []
    refresh = fx_utils.FakeTensorUpdater.incremental_update
    monkeypatch.setattr(fx_utils.FakeTensorUpdater, "incremental_update", lambda self: refreshed.append(self) or refresh(self))
    f = gather_matmul(world)
    for codegen, inner in ((False, 7), (True, 11)):  # (shapes no other test compiles: no cache hit)
        torch._dynamo.reset()
        torch.compile(f, backend="commfuse", options={"schedule": "ring", "codegen": codegen})(torch.randn(4, inner), torch.randn(inner, 4))
        assert commfuse_compile.last_report().rewritten
        assert bool(refreshed) is codegen, (codegen, len(refreshed))


def test_missing_private_api_names_torch_version():
    message = str(_missing("torch._inductor.some_api", ImportError("gone")))
    assert torch.__version__ in message and "torch._inductor.some_api" in message and "2.13" in message


def test_cache_key_covers_the_group_layout(world, monkeypatch):
    """The rings bake in the rank's index in its group and the group's size; a group name (a
    counter of new_group calls) can mean other members in another run."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    def key() -> str:
        return CommfusePass(CommfuseOptions(), new_report({})).uuid()

    before = key()
    group = dist.new_group([0, 1])  # this is rank 1 of 2: index 1 in the group
    with_group = key()
    assert with_group != before
    monkeypatch.setitem(_world.pg_group_ranks, group, {1: 0, 2: 1})  # same name: rank 1 is index 0 of [1, 2]
    assert key() != with_group
    monkeypatch.setitem(_world.pg_group_ranks, group, {0: 0, 1: 1})
    assert key() == with_group


def test_mode_applies_inductor_options(world, monkeypatch):
    """torch.compile(mode=...) reaches the backend as ``mode`` (it passes mode or options,
    never both): Inductor's options of the mode are applied, as Inductor applies them."""
    import torch._inductor.compile_fx as compile_fx_module

    seen = []

    def capture(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(config_patches)
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", capture)
    f, inputs = gather_matmul(world), (torch.randn(4, 8), torch.randn(8, 4))
    for mode, expected in [
        ("max-autotune-no-cudagraphs", {"max_autotune": True, "coordinate_descent_tuning": True}),
        ("max-autotune", {"max_autotune": True, "coordinate_descent_tuning": True, "triton.cudagraphs": True}),
        ("reduce-overhead", {"triton.cudagraphs": True}),
        (None, {}),
    ]:
        torch._dynamo.reset()
        torch.compile(f, backend="commfuse", mode=mode)(*inputs)
        patches = dict(seen[-1])
        assert isinstance(patches.pop("post_grad_custom_post_pass"), CommfusePass)
        assert patches == expected, mode
        assert commfuse_compile.last_report().options["mode"] == (mode or "default")
    torch._dynamo.reset()
    torch.compile(f, backend="commfuse", options={"mode": "max-autotune", "schedule": "ring"})(*inputs)
    assert seen[-1]["max_autotune"] is True


def test_mode_errors_name_the_mode():
    from commfuse_compile.backend import commfuse

    with pytest.raises(ValueError, match="'mode' must be one of .*got 'lite' \\('lite' turns off"):
        commfuse(None, [], mode="lite")
    with pytest.raises(ValueError, match="mode='max-autotune' and options=\\{'mode': 'default'\\} disagree"):
        commfuse(None, [], options={"mode": "default"}, mode="max-autotune")


def test_plan_comparison_names_options_and_matches():
    from commfuse_compile.plan_check import compare_plans

    def plan(schedule, strict=False, decision="rewrite"):
        site = dict(kind="all_gather_matmul", input=[256, 256], dtype="float32", decision=decision, schedule=schedule, chunks_per_rank=1)
        return dict(token="t", graph="backward", sites=[site], options={"schedule": schedule, "strict": strict})

    problem, harmless = compare_plans([plan("ring"), plan("ring"), plan("bidirectional")], [4, 5, 6])
    assert "planned the backward graph differently" in problem and not harmless
    assert "match #0 is all_gather_matmul of input [256, 256] (float32), ring(m=1) on rank 4 and" in problem
    assert "bidirectional(m=1) on rank 6" in problem
    assert "'schedule' is 'ring' on rank 4, 'ring' on rank 5, 'bidirectional' on rank 6" in problem
    same_options = plan("ring")
    same_options["sites"][0]["decision"] = "skip"
    problem, _ = compare_plans([plan("ring"), same_options], [0, 1])
    assert "left alone on rank 1" in problem and "Their options are the same" in problem
    assert compare_plans([plan("ring"), plan("ring", strict=True)], [0, 1]) == ("", "their options differ: 'strict' is False on rank 0, True on rank 1")
    assert compare_plans([plan("ring"), plan("ring")], [0, 1]) == ("", "")


def test_one_name_per_pattern():
    """The pattern registry, min_speedup's keys and the cost model's workloads use one name
    (an all-reduce is planned as the two patterns it splits into)."""
    from commfuse_compile.options import PATTERN_KINDS
    from commfuse_compile.passes import PATTERNS

    assert set(PATTERN_KINDS) == {name for name, p in PATTERNS.items() if not hasattr(p, "splits_into")}
    assert {half for p in PATTERNS.values() for half in getattr(p, "splits_into", ())} <= set(PATTERN_KINDS)
    for name, pattern in PATTERNS.items():
        assert pattern.name == name and pattern.collectives
        assert getattr(CommfuseOptions(), pattern.option) is True
