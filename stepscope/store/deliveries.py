"""The webhook outbox: one row per (finding, URL), claimed by one sender, retried, marked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from stepscope.store import tables

_MAX_ERROR_CHARS = 500


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """A notification to send: its key, the JSON body and the attempts made so far."""

    job_id: str
    finding_key: str
    target: str
    payload: dict[str, Any]
    attempts: int


def enqueue(engine: sa.Engine, deliveries: Sequence[Delivery], now: float) -> None:
    """Store deliveries not stored before (by job, finding and target), due now."""
    if not deliveries:
        return
    t = tables.webhook_deliveries
    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    statement = insert(t).on_conflict_do_nothing(
        index_elements=[t.c.job_id, t.c.finding_key, t.c.target]
    )
    rows = [
        {
            "job_id": d.job_id,
            "finding_key": d.finding_key,
            "target": d.target,
            "payload": d.payload,
            "created_at": now,
            "attempts": d.attempts,
            "next_attempt_at": now,
        }
        for d in deliveries
    ]
    with engine.begin() as conn:
        conn.execute(statement, rows)


def claim_due(
    engine: sa.Engine, now: float, *, targets: Sequence[str], lease_s: float, limit: int
) -> list[Delivery]:
    """Deliveries to `targets` due by `now`, each claimed for `lease_s` (another sender skips
    it meanwhile; a sender that dies leaves it due again when the lease ends)."""
    t = tables.webhook_deliveries
    due = (
        sa.select(t.c.job_id, t.c.finding_key, t.c.target, t.c.payload, t.c.attempts)
        .add_columns(t.c.next_attempt_at)
        .where(t.c.next_attempt_at <= now, t.c.target.in_(list(targets)))
        .order_by(t.c.next_attempt_at)
        .limit(limit)
    )
    claimed = []
    with engine.connect() as conn:
        rows = conn.execute(due).all()
    for row in rows:
        with engine.begin() as conn:
            taken = conn.execute(
                sa.update(t)
                .where(
                    t.c.job_id == row.job_id,
                    t.c.finding_key == row.finding_key,
                    t.c.target == row.target,
                    t.c.next_attempt_at == row.next_attempt_at,
                )
                .values(next_attempt_at=now + lease_s)
            )
        if taken.rowcount == 1:
            claimed.append(
                Delivery(
                    job_id=row.job_id,
                    finding_key=row.finding_key,
                    target=row.target,
                    payload=dict(row.payload),
                    attempts=int(row.attempts),
                )
            )
    return claimed


def record_attempt(
    engine: sa.Engine,
    delivery: Delivery,
    *,
    delivered_at: float | None,
    next_attempt_at: float | None,
    error: str | None,
) -> None:
    """Store the outcome of one attempt: delivered, due again at next_attempt_at, or given up
    (neither)."""
    t = tables.webhook_deliveries
    with engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(
                t.c.job_id == delivery.job_id,
                t.c.finding_key == delivery.finding_key,
                t.c.target == delivery.target,
            )
            .values(
                attempts=delivery.attempts + 1,
                delivered_at=delivered_at,
                next_attempt_at=next_attempt_at,
                last_error=None if error is None else error[:_MAX_ERROR_CHARS],
            )
        )
