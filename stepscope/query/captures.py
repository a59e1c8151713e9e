"""A job's deep captures (#21): each request's ranks, their top operators side by side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from stepscope.analysis.captures.traces import compare_summaries
from stepscope.query.common import require_job
from stepscope.store import captures


@dataclass(frozen=True, slots=True)
class CaptureRequest:
    """One request: its reason, its captures (one per rank, without traces), the comparison."""

    id: int
    job_id: str
    reason: str
    requested_by: str
    requested_at: float
    num_steps: int
    finding: dict[str, Any] | None
    captures: list[dict[str, Any]]
    comparison: list[dict[str, Any]] = field(default_factory=list)
    """Operators of the culprit and the reference side by side, largest difference first;
    empty until both traces are stored."""


def job_captures(engine: sa.Engine, job_id: str) -> list[CaptureRequest]:
    """The job's capture requests, newest first; JobNotFound for an unknown job."""
    require_job(engine, job_id)
    with engine.connect() as conn:
        stored = captures.load_requests(conn, job_id)
    result = []
    for request in stored:
        by_role = {c["role"]: c for c in request["captures"] if c["status"] == "uploaded"}
        comparison = (
            compare_summaries(by_role["culprit"]["summary"], by_role["reference"]["summary"])
            if {"culprit", "reference"} <= set(by_role)
            else []
        )
        result.append(
            CaptureRequest(
                **{k: request[k] for k in CaptureRequest.__dataclass_fields__ if k in request},
                comparison=comparison,
            )
        )
    return result


@dataclass(frozen=True, slots=True)
class Trace:
    """A stored trace, gzipped, and the file name to save it as."""

    filename: str
    trace_gz: bytes


class TraceNotFound(LookupError):
    """No capture with this id, or its trace is not stored (yet)."""


def capture_trace(engine: sa.Engine, capture_id: int, *, job_id: str | None = None) -> Trace:
    """The capture's gzipped trace (of `job_id`'s, when given); TraceNotFound when it has
    none."""
    with engine.connect() as conn:
        found = captures.load_trace(conn, capture_id)
    if found is None or (job_id is not None and found[0] != job_id):
        raise TraceNotFound(f"no capture {capture_id}" + (f" of job {job_id}" if job_id else ""))
    job_id, rank, trace_gz = found
    if trace_gz is None:
        raise TraceNotFound(f"capture {capture_id} has no trace (not uploaded)")
    safe_job = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in job_id)
    return Trace(f"{safe_job}-rank{rank}-capture{capture_id}.pt.trace.json.gz", trace_gz)
