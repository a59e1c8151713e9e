"""Goodput over all jobs in a time window (docs/goodput.md, the fleet view): each job's
GPU-time inside [since, until) by category, and their sums."""

from __future__ import annotations

import math
from dataclasses import dataclass

import sqlalchemy as sa

from stepscope.analysis.goodput import job as gp
from stepscope.query.goodput import job_goodput
from stepscope.schema import GOODPUT_CATEGORIES
from stepscope.store import jobs

STARTUP_MARGIN_S = 6 * 3600.0
"""A job whose first step came this long after `until` may still have started its processes
inside the window (the jobs row keeps the first step's time); later ones are not read."""
MAX_JOBS = 500
"""Most jobs a fleet answer reads; a wider window is refused (narrow it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobShare:
    """One job's GPU-time inside the window."""

    job_id: str
    name: str | None
    world_size: int
    gpu_s: float
    categories: dict[str, float]
    """GPU-seconds per category inside the window; they add up to gpu_s."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetGoodput:
    """Every job's GPU-time inside [since, until), by category, and the sums."""

    since: float
    until: float
    gpu_s: float
    categories: dict[str, float]
    jobs: list[JobShare]
    """Jobs with GPU-time in the window, most GPU-time lost first."""

    @property
    def goodput(self) -> float:
        """Productive share of the window's GPU-time (0 when there is none)."""
        return self.categories["productive"] / self.gpu_s if self.gpu_s > 0 else 0.0


def fleet_goodput(engine: sa.Engine, *, since: float, until: float) -> FleetGoodput:
    """Goodput over the jobs that ran in [since, until): each job's part of its GPU-time
    inside the window (a job across an edge counts for its part only)."""
    if not (math.isfinite(since) and math.isfinite(until)):
        raise ValueError("since and until must be finite epoch seconds")
    if until <= since:
        raise ValueError(f"until must be after since; got since={since:g}, until={until:g}")
    candidates = jobs.jobs_between(
        engine, started_before=until + STARTUP_MARGIN_S, ended_after=since, limit=MAX_JOBS + 1
    )
    if len(candidates) > MAX_JOBS:
        raise ValueError(
            f"since: more than {MAX_JOBS} jobs ran between since and until; narrow the window"
        )
    rows = []
    totals: dict[str, float] = dict.fromkeys(GOODPUT_CATEGORIES, 0.0)
    for job_id, name in candidates:
        result = job_goodput(engine, job_id, with_windows=False).result
        part = gp.within(result, since, until)
        if part["gpu_s"] <= 0:
            continue
        categories: dict[str, float] = {c: part[c] for c in GOODPUT_CATEGORIES}
        for c, v in categories.items():
            totals[c] += v
        rows.append(
            JobShare(
                job_id=job_id,
                name=name,
                world_size=result.world_size,
                gpu_s=part["gpu_s"],
                categories=categories,
            )
        )
    rows.sort(key=lambda r: (-(r.gpu_s - r.categories["productive"]), r.job_id))
    return FleetGoodput(
        since=since,
        until=until,
        gpu_s=sum(r.gpu_s for r in rows),
        categories=totals,
        jobs=rows,
    )
