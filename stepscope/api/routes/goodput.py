"""A job's goodput (#20): where its GPU-time went, per category, incarnation and rank."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query

from stepscope.api.deps import EngineDep, JobIdDep, ReadAuth
from stepscope.api.errors import ERROR_RESPONSES, JOB_RESPONSES
from stepscope.api.goodput_read import FleetGoodputRead, GoodputRead, fleet_read, goodput_read
from stepscope.query.goodput import job_goodput
from stepscope.query.goodput_fleet import fleet_goodput

router = APIRouter(tags=["jobs"])


@router.get("/goodput", summary="Goodput over all jobs in a time window", responses=ERROR_RESPONSES)
def fleet_goodput_route(
    engine: EngineDep,
    _auth: ReadAuth,
    since: Annotated[float, Query(description="Window start, epoch seconds")],
    until: Annotated[
        float | None, Query(description="Window end, epoch seconds (default: now)")
    ] = None,
) -> FleetGoodputRead:
    """Every job's GPU-time inside [since, until) by category, in GPU-hours and shares, and
    their sums (a job across an edge counts for its part inside)."""
    return fleet_read(
        fleet_goodput(engine, since=since, until=until if until is not None else time.time())
    )


@router.get("/jobs/{job_id}/goodput", summary="A job's goodput and badput", responses=JOB_RESPONSES)
def job_goodput_route(
    engine: EngineDep,
    job_id: JobIdDep,
    _auth: ReadAuth,
    per_rank: Annotated[bool, Query(description="Add every rank's categories")] = False,
    window_s: Annotated[
        float | None,
        Query(gt=0, description="Length of the windows over time, seconds (default: ~100)"),
    ] = None,
) -> GoodputRead:
    """Totals, categories (GPU-seconds and share), Google's three layers, per incarnation,
    over time (consecutive windows), and per rank on request."""
    return goodput_read(job_goodput(engine, job_id, per_rank=per_rank, window_s=window_s))
