"""Jobs: the list, a job's summary and findings, re-analysis and deletion."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import APIRouter, Query

from stepscope import query
from stepscope.api.deps import (
    MAX_RANK,
    NO_NUL,
    AdminAuth,
    EngineDep,
    FindingsHookDep,
    IngestAuth,
    JobIdDep,
    PassResourcesDep,
    ReadAuth,
    RollupGraceDep,
)
from stepscope.api.errors import JOB_RESPONSES
from stepscope.api.schemas import (
    DeletedRead,
    FindingRead,
    JobsPage,
    JobStatus,
    JobSummaryRead,
    MetricPointRead,
    Severity,
)
from stepscope.pipeline.job_pass import analyze_stored_job
from stepscope.store.deletion import delete_job as delete_stored_job

if TYPE_CHECKING:
    JobSort = str
else:
    JobSort = Literal[tuple(s for k in query.JOB_SORT_KEYS for s in (k, f"-{k}"))]

router = APIRouter(tags=["jobs"], responses=JOB_RESPONSES)

Timestamp = Annotated[
    datetime | None,
    Query(description="ISO 8601 (UTC when no offset is given) or epoch seconds"),
]


def _epoch_s(when: datetime | None) -> float | None:
    if when is None:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


@router.get("/jobs", summary="List jobs")
def list_jobs(
    engine: EngineDep,
    _auth: ReadAuth,
    status: Annotated[list[JobStatus] | None, Query(description="Any of these statuses")] = None,
    benchmark_key: Annotated[str | None, Query(max_length=1024, pattern=NO_NUL)] = None,
    name: Annotated[
        str | None,
        Query(max_length=1024, pattern=NO_NUL, description="Substring of the name, any case"),
    ] = None,
    started_after: Timestamp = None,
    started_before: Timestamp = None,
    min_severity: Annotated[
        Severity | None, Query(description="Has a finding of at least this severity")
    ] = None,
    sort: Annotated[JobSort, Query(description="A key; a leading '-' sorts descending")] = (
        "-started_at"
    ),
    cursor: Annotated[
        str | None, Query(max_length=4096, description="next_cursor of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> JobsPage:
    """A page of the jobs that pass the filters, in `sort` order; `next_cursor` continues."""
    filters = query.JobFilters(
        status=tuple(status or ()),
        benchmark_key=benchmark_key,
        name_contains=name,
        started_after=_epoch_s(started_after),
        started_before=_epoch_s(started_before),
        min_severity=min_severity,
    )
    page = query.list_jobs(engine, filters, sort=sort, cursor=cursor, limit=limit)
    return JobsPage.of(page)


@router.get("/jobs/{job_id}", summary="A job's summary")
def job_summary(engine: EngineDep, job_id: JobIdDep, _auth: ReadAuth) -> JobSummaryRead:
    """Size, progress, status, device, step time p50/p90, tokens/s, samples/s, MFU, the data,
    compute and comm-wait shares of the step, and findings by severity."""
    return JobSummaryRead.of(query.job_summary(engine, job_id))


@router.get("/jobs/{job_id}/findings", summary="A job's findings")
def findings(engine: EngineDep, job_id: JobIdDep, _auth: ReadAuth) -> list[FindingRead]:
    """The job's findings in the order the analysis stored them."""
    return [FindingRead.of(f) for f in query.findings(engine, job_id)]


@router.get("/jobs/{job_id}/metrics", summary="A job's OTLP metric points")
def metric_points(
    engine: EngineDep,
    job_id: JobIdDep,
    _auth: ReadAuth,
    name: Annotated[str | None, Query(description="Only this metric", pattern=NO_NUL)] = None,
    rank: Annotated[int | None, Query(ge=0, le=MAX_RANK, description="Only this rank")] = None,
    limit: Annotated[int, Query(ge=1, le=100_000, description="At most this many")] = 1000,
) -> list[MetricPointRead]:
    """Points received at POST /v1/metrics other than GPU telemetry (which is in the GPU
    charts), by metric name, rank and time."""
    points = query.metric_points(engine, job_id, name=name, rank=rank, limit=limit)
    return [MetricPointRead.model_validate(p) for p in points]


@router.post(
    "/jobs/{job_id}/analyze",
    summary="Re-analyse a job now",
    responses={409: {"model": JOB_RESPONSES[404]["model"], "description": "Raw rows pruned"}},
)
def analyze(
    engine: EngineDep,
    rollup_grace_s: RollupGraceDep,
    on_findings: FindingsHookDep,
    resources: PassResourcesDep,
    job_id: JobIdDep,
    _auth: IngestAuth,
    full: Annotated[
        bool, Query(description="Rebuild rollups and findings from the raw rows")
    ] = False,
) -> list[FindingRead]:
    """Bring the job's rollups and findings up to date (scope ingest or admin); its findings."""
    query.job_summary(engine, job_id)  # 404 for an unknown job
    analyze_stored_job(
        engine,
        job_id,
        full=full,
        grace_s=rollup_grace_s,
        on_findings=on_findings,
        resources=resources,
    )
    return [FindingRead.of(f) for f in query.findings(engine, job_id)]


@router.delete("/jobs/{job_id}", summary="Delete a job")
def delete_job(engine: EngineDep, job_id: JobIdDep, _auth: AdminAuth) -> DeletedRead:
    """Delete the job and everything derived from it (scope admin)."""
    deleted = delete_stored_job(engine, job_id)
    if not deleted.get("jobs"):
        raise query.JobNotFound(job_id)
    return DeletedRead(job_id=job_id, deleted_rows=deleted)
