"""A job's goodput (#20): where its GPU-time went, per category, incarnation and rank."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from stepscope.api.deps import EngineDep, JobIdDep, ReadAuth
from stepscope.api.errors import JOB_RESPONSES
from stepscope.api.goodput_read import GoodputRead, goodput_read
from stepscope.query.goodput import job_goodput

router = APIRouter(tags=["jobs"], responses=JOB_RESPONSES)


@router.get("/jobs/{job_id}/goodput", summary="A job's goodput and badput")
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
