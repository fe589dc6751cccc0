"""What a pattern is: the interface every pattern's module implements, and their registry.

A pattern is one kind of collective next to compute that commfuse decomposes. Its module (one
per pattern: :mod:`.all_gather_matmul`, :mod:`.matmul_reduce_scatter`, and :mod:`.all_reduce`,
which splits into one of each) states in its docstring what it matches, what the cost model
times and what it emits, and implements:

- ``match``: a :class:`~.site.Site` for each collective it recognises (skips carry their reason),
  or None to leave it to the next pattern of the same collective (a specific form first);
- ``keep_computable`` / ``cut_problem``: whether the matched matmuls can be cut into pieces;
- ``workload``: the cost model's :class:`~commfuse_compile.cost_model.Workload` of a match, from
  what every rank of the group shares;
- ``emit``: the rewrite under the planned schedule (ring, bidirectional ring, slicing);
- ``reserved``: the nodes that belong to a match (never fused into another match's ring).

The planner (:mod:`.plan`), the rewrite dispatch (:mod:`.rewrite`) and the pipeline read a
pattern only through this interface. A new pattern is a new module with a class like these and
one line in :data:`PATTERNS` (``passes/__init__.py``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, ClassVar

import torch.fx as fx

from .site import Site

if TYPE_CHECKING:
    from commfuse_compile.cost_model import Workload

    from .fusion import Fuse
    from .site import Consumer


class Pattern:
    """Base of every pattern: the names it goes by and the hooks the pipeline calls."""

    name: ClassVar[str]  # the one name: Site.pattern, SiteRecord.pattern, min_speedup's key
    flash: ClassVar[str]  # how the rewrite is named in reasons ("Flash-AG")
    option: ClassVar[str]  # the option that turns the pattern off ("flash_ag")
    collectives: ClassVar[frozenset]  # the collective ops whose sites this pattern makes

    def match(self, node: fx.Node, graph_kind: str) -> Site | None:
        """A Site for ``node`` (a skip carries its reason), or None where the node is not in
        this pattern's form and the next pattern for its collective should look at it."""
        raise NotImplementedError(f"{type(self).__name__} does not define match()")

    def claims(self, site: Site) -> set[fx.Node]:
        """Other collectives the site rewrites too (an MoE layer's combine): no site of their own."""
        return set()

    def keep_computable(self, site: Site, tensor: list[int]) -> str | None:
        """Drop (or refuse) matmuls that cannot be cut into the N chunks; why the whole site
        cannot be rewritten, if so."""
        raise NotImplementedError(f"{type(self).__name__} does not define keep_computable()")

    def cut_problem(self, site: Site, tensor: list[int], consumer: Consumer, count: int) -> str | None:
        """Why ``consumer`` cannot be computed in ``count`` pieces of the site's tensor, if so."""
        raise NotImplementedError(f"{type(self).__name__} does not define cut_problem()")

    def schedule_problem(self, schedule: str, m: int) -> str | None:
        """Why the pattern has no rewrite under ``schedule`` with m pieces, if so (None by default)."""
        return None

    def workload(self, site: Site) -> Workload:
        raise NotImplementedError(f"{type(self).__name__} does not define workload()")

    def describe(self, site: Site) -> str:
        """Extra words for the reason of a rewritten site ("" by default)."""
        return ""

    def emit(self, graph: fx.Graph, site: Site, rank: int, tags: itertools.count, fuse: Fuse) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not define emit()")

    def reserved(self, site: Site) -> set[fx.Node]:
        """The nodes of a match: its collective, wait and tensor, and its matmuls with the views
        around them."""
        nodes = {site.collective, site.wait, site.tensor, *site.layout, *site.prologue}
        for consumer in site.consumers:
            nodes |= {consumer.mm, *consumer.views, *consumer.permutes}
        return nodes
