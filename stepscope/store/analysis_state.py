"""Where a job's incremental analysis stands: its watermark and state, the batches that
arrived since, and the summary a pass leaves (DESIGN §6)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from stepscope.store import tables
from stepscope.store.rollup_tables import Connectable, connection


@dataclass(frozen=True, slots=True)
class Arrivals:
    """What the batches of a job received after some time touched."""

    received_at: float
    """When the newest of them arrived."""
    first_step: int | None
    last_step: int | None
    first_gpu_ts: float | None
    last_gpu_ts: float | None
    num_batches: int


def arrivals_since(db: Connectable, job_id: str, after: float) -> Arrivals | None:
    """The extent of the job's batches received after `after`; None if there are none."""
    b = tables.IngestBatch
    query = sa.select(
        sa.func.max(b.received_at),
        sa.func.min(b.first_step),
        sa.func.max(b.last_step),
        sa.func.min(b.first_gpu_ts),
        sa.func.max(b.last_gpu_ts),
        sa.func.count(),
    ).where(b.job_id == job_id, b.received_at > after)
    with connection(db) as conn:
        row = conn.execute(query).one()
    if row[0] is None:
        return None
    return Arrivals(*row)


def count_batches(db: Connectable, job_id: str, after: float, upto: float) -> int:
    """How many of the job's batches were received after `after` and up to `upto`."""
    b = tables.IngestBatch
    query = sa.select(sa.func.count()).where(
        b.job_id == job_id, b.received_at > after, b.received_at <= upto
    )
    with connection(db) as conn:
        return int(conn.execute(query).scalar_one())


def load_state(db: Connectable, job_id: str) -> tuple[float, dict[str, Any]] | None:
    """(watermark, state) of a job's incremental analysis; None before its first pass."""
    t = tables.analysis_state
    with connection(db) as conn:
        row = conn.execute(sa.select(t.c.watermark, t.c.state).where(t.c.job_id == job_id)).first()
    return None if row is None else (float(row.watermark), dict(row.state))


def save_state(
    conn: sa.Connection, job_id: str, watermark: float, state: dict[str, Any], now: float
) -> None:
    """Store where a job's incremental analysis stands."""
    t = tables.analysis_state
    conn.execute(sa.delete(t).where(t.c.job_id == job_id))
    conn.execute(
        sa.insert(t).values(job_id=job_id, watermark=watermark, state=state, updated_at=now)
    )


def save_summary(
    conn: sa.Connection,
    job_id: str,
    summary: dict[str, Any],
    severities: Mapping[str, int],
    now: float,
) -> None:
    """Store a job's summary (stepscope.analysis.rollups.steady_summary) and finding counts."""
    t = tables.job_summaries
    conn.execute(sa.delete(t).where(t.c.job_id == job_id))
    counts = {f"num_{s}": severities.get(s, 0) for s in ("info", "warning", "critical")}
    conn.execute(sa.insert(t).values(job_id=job_id, **summary, **counts, updated_at=now))
