"""Which site a failure belongs to: a problem with one site costs that site, not the graph.

Every stage that works site by site runs each site's part under :func:`blame`. An exception
there becomes a :class:`SiteFailure` naming the site, its collective node and the stage. The
pipeline (:func:`commfuse_compile.passes.run_pipeline`) then puts the graph back as it was and
runs every stage again with that site left alone: the site is recorded as skipped with the
failure as its reason, and the other sites are rewritten as before. ``strict=True`` raises
the error instead.

A stage may also decide on its own that a site cannot be kept (the order stage, when two rings
need each other's results): it raises :class:`SiteFailure` with a ``reason`` and no error. That
is a skip like any other, not a bug, and ``strict`` does not raise for it.
"""

from __future__ import annotations

import contextlib
import pathlib
import traceback
from collections.abc import Iterator

from .site import Site


class SiteFailure(Exception):
    """``site`` cannot be rewritten: ``stage`` raised ``error``, or decided so for ``reason``."""

    def __init__(self, site: Site, stage: str, error: BaseException | None = None, reason: str | None = None):
        self.site, self.stage, self.error = site, stage, error
        if reason is None:
            reason = f"the pass failed while {stage} this site ({describe_error(error)}); left to the plain collective"
        self.reason = reason
        super().__init__(f"{where(site)}: {reason}")


def describe_error(error: BaseException) -> str:
    """``Type: message``; for an error raised without a message (a bare ``assert``), where it
    was raised instead."""
    if str(error):
        return f"{type(error).__name__}: {error}"
    frames = traceback.extract_tb(error.__traceback__)
    at = f", raised at {pathlib.Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}()" if frames else ""
    return f"{type(error).__name__} with no message{at}"


def where(site: Site) -> str:
    """The site as an error message names it: its collective node, pattern and graph."""
    return f"{site.collective.name} ({site.pattern}, {site.graph} graph)"


@contextlib.contextmanager
def blame(site: Site, stage: str) -> Iterator[None]:
    """Run one site's part of ``stage`` ("planning", "emitting", "ordering" ...): whatever it
    raises is that site's :class:`SiteFailure`."""
    try:
        yield
    except SiteFailure:
        raise
    except Exception as err:
        raise SiteFailure(site, stage, err) from err
