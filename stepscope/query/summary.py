"""A job's summary and its findings."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from stepscope import schema
from stepscope.query.common import JobNotFound, check_at_least, require_job
from stepscope.query.jobs import STALE_AFTER_S
from stepscope.store import reads


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSummary:
    """A job: identity, size, progress, status, steady-state figures and findings by severity.

    Figures come from the analyzer's job summary: None until the job was first analysed.
    """

    job_id: str
    name: str | None
    benchmark_key: str | None
    status: str
    """running, stale (no batch for stale_after_s), finished or failed."""
    world_size: int | None
    num_nodes: int | None
    num_ranks_seen: int | None
    num_steps: int | None
    """Steps rolled up so far."""
    first_step: int | None
    last_step: int | None
    device_name: str | None
    peak_flops: float | None
    started_at: float | None
    ended_at: float | None
    last_seen: float | None
    """When the job's last batch arrived (epoch s)."""
    step_p50_s: float | None
    step_p90_s: float | None
    tokens_per_s: float | None
    samples_per_s: float | None
    mfu: float | None
    data_share: float | None
    compute_share: float | None
    comm_wait_share: float | None
    num_info: int | None
    num_warning: int | None
    num_critical: int | None
    analysed_at: float | None
    """When the analyzer last updated the figures (epoch s)."""
    attributes: dict[str, Any] | None
    num_records_dropped: int = 0
    """Records the job's profilers dropped and reported (buffer full, collector unreachable):
    the stored rows miss exactly these."""


def job_summary(
    engine: sa.Engine, job_id: str, *, stale_after_s: float = STALE_AFTER_S
) -> JobSummary:
    """The summary of a job; raises JobNotFound for an unknown job."""
    query = reads.JobQuery(job_id=job_id, stale_before=time.time() - stale_after_s)
    rows = reads.read_jobs(engine, query)
    if not rows:
        raise JobNotFound(job_id)
    row = {
        **rows[0],
        "analysed_at": rows[0]["updated_at"],
        "num_records_dropped": records_dropped(engine, job_id),
    }
    return JobSummary(**{name: row[name] for name in JobSummary.__dataclass_fields__})


def records_dropped(engine: sa.Engine, job_id: str) -> int:
    """How many records the job's profilers reported dropping, all kinds together."""
    return sum(
        int(count)
        for report in reads.read_drop_reports(engine, job_id)
        for key, count in report.items()
        if key.startswith("dropped_") and isinstance(count, int)
    )


@dataclass(kw_only=True, slots=True)
class StoredFinding(schema.Finding):
    """A stored finding and its row id (each analysis pass stores findings anew: new ids)."""

    id: int


def findings(engine: sa.Engine, job_id: str) -> list[StoredFinding]:
    """The job's findings in the order analysis stored them."""
    require_job(engine, job_id)
    return [
        StoredFinding(**{k: row[k] for k in ("id", *schema.FINDINGS.names)})
        for row in reads.read_findings(engine, job_id)
    ]


def events(engine: sa.Engine, job_id: str, *, limit: int = 500) -> list[dict[str, Any]]:
    """The job's first `limit` events by time: rank, ts, kind, message and attributes (a
    JSON value or None), as stored."""
    check_at_least("limit", limit, 1)
    require_job(engine, job_id)
    return reads.read_events(engine, job_id, limit)


def metric_points(
    engine: sa.Engine,
    job_id: str,
    *,
    name: str | None = None,
    rank: int | None = None,
    limit: int = 1000,
) -> list[dict[str, Any]]:
    """The job's OTLP metric points (POST /v1/metrics, other than GPU telemetry): rank, name,
    attributes, ts, kind, unit, value, and a histogram's count, min, max, bounds and counts."""
    check_at_least("limit", limit, 1)
    require_job(engine, job_id)
    return reads.read_otlp_metrics(engine, job_id, name=name, rank=rank, limit=limit)
