"""Stage 6 — report: turn each Site into a SiteRecord, log it and add it to the compile report."""

from __future__ import annotations

from commfuse_compile.report import Report, SiteRecord, StepRecord, log

from .site import Site


def record_sites(sites: list[Site], report: Report) -> None:
    for site in sites:
        record = SiteRecord(
            graph=site.graph,
            pattern=site.pattern,
            collective=site.collective.name,
            group_name=str(site.group_name),
            group_size=int(site.group_size),
            shapes=dict(site.shapes),
            action="rewritten" if site.decision == "rewrite" else "skipped",
            reason=site.reason,
            notes=tuple(site.notes),
            rank=site.rank,
            schedule=site.schedule if site.decision == "rewrite" else None,
            chunks_per_rank=site.chunks_per_rank if site.decision == "rewrite" else None,
            profile=site.profile,
            estimates=dict(site.estimates),
            fused=tuple(n.name for n in site.fused),
            dim=site.dim,
            region=tuple(site.region),
            modeled=tuple(site.modeled),
            steps=tuple(
                StepRecord(
                    chunk=step.chunk,
                    start=step.start.name if step.start is not None else None,
                    compute=tuple(n.name for n in step.compute),
                    wait=step.wait.name if step.wait is not None else None,
                )
                for step in site.steps
            ),
        )
        report.sites.append(record)
        log.info("commfuse %s", record.summary())
