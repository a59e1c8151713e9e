"""Deep captures (#21) as the API answers them: each request's ranks, their top operators and
the two side by side (the routes and the CLI's LocalStore build them alike)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel

from stepscope import schema
from stepscope.query.captures import job_captures


class OperatorRead(BaseModel):
    name: str
    category: str
    count: int
    total_s: float


class CaptureRead(BaseModel):
    """One rank's capture: its status and, once uploaded, the trace's size and top operators."""

    id: int
    rank: int
    role: schema.CaptureRole
    status: schema.CaptureStatus
    delivered_at: float | None
    finished_at: float | None
    first_step: int | None
    last_step: int | None
    error: str | None
    trace_bytes: int | None
    operators: list[OperatorRead]
    download: str | None
    """Where the gzipped trace is (GET, scope read), once uploaded."""

    @classmethod
    def of(cls, row: dict[str, Any]) -> CaptureRead:
        summary = row.get("summary") or {}
        fields = {k: row[k] for k in cls.model_fields if k in row}
        download = f"/api/v1/captures/{row['id']}/trace" if row["status"] == "uploaded" else None
        return cls(**fields, operators=summary.get("operators", []), download=download)


class OperatorDifference(BaseModel):
    name: str
    category: str
    culprit_s: float
    reference_s: float
    difference_s: float


class CaptureRequestRead(BaseModel):
    """A capture request: why, its captures, and their operators side by side."""

    id: int
    job_id: str
    reason: str
    """The finding kind that asked, or "user"."""
    requested_by: str
    requested_at: float
    num_steps: int
    finding: dict[str, Any] | None
    captures: list[CaptureRead]
    comparison: list[OperatorDifference]


def capture_requests(engine: sa.Engine, job_id: str) -> list[CaptureRequestRead]:
    """The job's capture requests, newest first; JobNotFound for an unknown job."""
    return [
        CaptureRequestRead(
            id=r.id,
            job_id=r.job_id,
            reason=r.reason,
            requested_by=r.requested_by,
            requested_at=r.requested_at,
            num_steps=r.num_steps,
            finding=r.finding,
            captures=[CaptureRead.of(c) for c in r.captures],
            comparison=[OperatorDifference(**d) for d in r.comparison],
        )
        for r in job_captures(engine, job_id)
    ]
