"""Stage 5 — check: every rank of a group must run the same plan; the first call compares them.

The plan of a site is a function of what every rank of its group shares (shapes of the
collective, dtype, group size, options), so the ranks of a group agree by construction — unless
they were given different options, or their graphs differ. To fail with a clear error instead of
a hang, the pass puts ``torch.ops.commfuse.check_plan(plan, group)`` first in every graph with a
match, once per process group: the plan is what each rank will send and receive, per match
(kind, shape and dtype of the collective's input, decision, schedule, m), with the options. On
the graph's first call the ranks compare them (:mod:`commfuse_compile.plan_check`)::

    before:  x = placeholder ... ; ag = all_gather_into_tensor(x, N, "0") ...
    after:   x = placeholder ... ; check_plan('{"graph": "forward", "sites": [...], ...}', "0")
             ag = ... (the rewritten steps)
"""

from __future__ import annotations

import json
import uuid

import torch
import torch.fx as fx

from commfuse_compile.options import CommfuseOptions

from .graph_utils import fake
from .site import Site


def plan_of(site: Site) -> dict:
    """What this rank will exchange for ``site``, in terms every rank of its group shares."""
    value = fake(site.tensor if site.pattern == "all_reduce" else site.collective.args[0])  # (a split one is erased)
    rewrite = site.decision == "rewrite"
    return dict(
        kind=site.pattern,
        input=[size if isinstance(size, int) else str(size) for size in value.shape],  # (symbols by name)
        dtype=str(value.dtype).removeprefix("torch."),
        decision="rewrite" if rewrite else "skip",
        schedule=site.schedule if rewrite else None,
        chunks_per_rank=site.chunks_per_rank if rewrite else None,
    )


def insert_plan_checks(graph: fx.Graph, sites: list[Site], plans: list[dict], options: CommfuseOptions, kind: str) -> list[fx.Node]:
    """One ``check_plan`` per process group of ``sites`` (their ``plans``: :func:`plan_of`;
    groups of one rank need none), at the start of ``graph``, in the order the groups first
    appear; returns them."""
    import commfuse_compile.plan_check  # noqa: F401  (registers torch.ops.commfuse.check_plan)

    groups: dict[str, list[dict]] = {}
    for site, plan in zip(sites, plans):
        if site.group_size > 1:
            groups.setdefault(site.group_name, []).append(plan)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    checks = []
    for group_name, members in groups.items():
        plan = dict(
            token=uuid.uuid4().hex,  # this graph's: each compiled graph is checked once
            graph=kind,
            sites=members,
            options=json.loads(options.cache_key()),
        )
        with graph.inserting_before(first):
            check = graph.call_function(torch.ops.commfuse.check_plan.default, (json.dumps(plan, sort_keys=True), group_name))
        check.meta["val"] = None
        checks.append(check)
    return checks
