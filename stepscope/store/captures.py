"""Deep captures (#21): requests, each rank's part, and the uploaded traces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from stepscope import schema
from stepscope.store import tables

MAX_CAPTURE_ID = 2**31 - 1
"""Capture ids are 32-bit integers (an Integer primary key on both engines)."""
_LISTED = tuple(c for c in tables.captures.columns if c.name != "trace_gz")


@dataclass(frozen=True, slots=True)
class Pending:
    """A capture a rank has yet to be told about."""

    capture_id: int
    job_id: str
    rank: int
    num_steps: int


def create_request(
    conn: sa.Connection,
    *,
    job_id: str,
    ranks: Sequence[tuple[int, schema.CaptureRole]],
    num_steps: int,
    reason: str,
    requested_by: str,
    requested_at: float,
    finding: dict[str, Any] | None = None,
) -> tuple[int, list[Pending]]:
    """Store a request and one capture per (rank, role); the request id and the captures."""
    r, c = tables.capture_requests, tables.captures
    request_id = conn.execute(
        sa.insert(r)
        .values(
            job_id=job_id,
            reason=reason,
            finding=finding,
            num_steps=num_steps,
            requested_at=requested_at,
            requested_by=requested_by,
        )
        .returning(r.c.id)
    ).scalar_one()
    pending = []
    for rank, role in ranks:
        capture_id = conn.execute(
            sa.insert(c)
            .values(request_id=request_id, job_id=job_id, rank=rank, role=role, status="requested")
            .returning(c.c.id)
        ).scalar_one()
        pending.append(Pending(int(capture_id), job_id, rank, num_steps))
    return int(request_id), pending


def pending_captures(conn: sa.Connection) -> list[Pending]:
    """Every capture not yet told to its rank, oldest first."""
    r, c = tables.capture_requests, tables.captures
    rows = conn.execute(
        sa.select(c.c.id, c.c.job_id, c.c.rank, r.c.num_steps)
        .join(r, r.c.id == c.c.request_id)
        .where(c.c.status == "requested")
        .order_by(c.c.id)
    ).all()
    return [Pending(int(row[0]), row[1], int(row[2]), int(row[3])) for row in rows]


def mark_delivered(conn: sa.Connection, capture_id: int, at: float) -> bool:
    """Note that the rank is told (in an ingest answer) at `at`; False if it was already."""
    c = tables.captures
    result = conn.execute(
        sa.update(c)
        .where(c.c.id == capture_id, c.c.status == "requested")
        .values(status="delivered", delivered_at=at)
    )
    return result.rowcount == 1


def capture_status(conn: sa.Connection, capture_id: int) -> str | None:
    """The capture's status; None for an unknown capture."""
    c = tables.captures
    return conn.execute(sa.select(c.c.status).where(c.c.id == capture_id)).scalar_one_or_none()


def save_trace(
    conn: sa.Connection,
    capture_id: int,
    *,
    trace_gz: bytes,
    summary: dict[str, Any],
    first_step: int | None,
    last_step: int | None,
    at: float,
) -> None:
    """Store the rank's gzipped trace and its summary."""
    c = tables.captures
    conn.execute(
        sa.update(c)
        .where(c.c.id == capture_id)
        .values(
            status="uploaded",
            finished_at=at,
            trace_gz=trace_gz,
            trace_bytes=len(trace_gz),
            summary=summary,
            first_step=first_step,
            last_step=last_step,
            error=None,
        )
    )


def save_failure(conn: sa.Connection, capture_id: int, *, error: str, at: float) -> None:
    """Note that the rank gave up, and why (a stored trace is kept)."""
    c = tables.captures
    conn.execute(
        sa.update(c)
        .where(c.c.id == capture_id, c.c.status != "uploaded")
        .values(status="failed", finished_at=at, error=error)
    )


def load_requests(conn: sa.Connection, job_id: str) -> list[dict[str, Any]]:
    """The job's capture requests, newest first, each with its captures (without traces)."""
    r, c = tables.capture_requests, tables.captures
    requests = [
        {**row, "captures": []}
        for row in conn.execute(
            sa.select(r).where(r.c.job_id == job_id).order_by(r.c.id.desc())
        ).mappings()
    ]
    by_id = {request["id"]: request for request in requests}
    rows = conn.execute(sa.select(*_LISTED).where(c.c.job_id == job_id).order_by(c.c.id))
    for row in rows.mappings():
        if row["request_id"] in by_id:
            by_id[row["request_id"]]["captures"].append(dict(row))
    return requests


def load_trace(conn: sa.Connection, capture_id: int) -> tuple[str, int, bytes | None] | None:
    """The capture's job, rank and gzipped trace (None before upload); None if unknown."""
    c = tables.captures
    row = conn.execute(
        sa.select(c.c.job_id, c.c.rank, c.c.trace_gz).where(c.c.id == capture_id)
    ).first()
    return None if row is None else (row[0], int(row[1]), row[2])


def captured_ranks(conn: sa.Connection, job_id: str, requested_by: str) -> set[int]:
    """Culprit ranks of the job's requests made by `requested_by`."""
    r, c = tables.capture_requests, tables.captures
    rows = conn.execute(
        sa.select(c.c.rank)
        .join(r, r.c.id == c.c.request_id)
        .where(c.c.job_id == job_id, c.c.role == "culprit", r.c.requested_by == requested_by)
    ).scalars()
    return {int(rank) for rank in rows}


def reported_ranks(conn: sa.Connection, job_id: str) -> list[int]:
    """The job's ranks that sent a batch, in order."""
    r = tables.ranks
    rows = conn.execute(sa.select(r.c.rank).where(r.c.job_id == job_id).order_by(r.c.rank))
    return [int(rank) for rank in rows.scalars()]


def job_ended(conn: sa.Connection, job_id: str) -> bool:
    """The job has an end time (finished or failed)."""
    j = tables.jobs
    ended = conn.execute(sa.select(j.c.ended_at).where(j.c.job_id == job_id)).first()
    return ended is not None and ended[0] is not None
