"""Retention: delete what old jobs no longer need, so a long-lived store stays bounded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import sqlalchemy as sa

from stepscope.store import tables

RAW_TABLES = (
    tables.steps,
    tables.collectives,
    tables.gpu_samples,
    tables.events,
    tables.job_columns,
    cast(sa.Table, tables.IngestBatch.__table__),
    tables.hang_reports,
    tables.otlp_metrics,
    tables.captures,
    tables.capture_requests,
)
"""What `prune --keep-rollups` deletes: the raw rows, which of their columns hold values, the
batches' idempotency keys, and the deep captures' traces (#21)."""
DERIVED_TABLES = (
    *tables.ROLLUP_TABLES,
    tables.webhook_deliveries,
    tables.findings,
    tables.ranks,
    tables.jobs,
)


@dataclass(kw_only=True, slots=True)
class PruneResult:
    job_ids: list[str]
    deleted_rows: dict[str, int] = field(default_factory=dict)
    """Rows deleted per table."""


def old_jobs(conn: sa.Connection, before: float) -> list[str]:
    """Jobs done before `before` (epoch s): finished then, or silent since (no batch after)."""
    j, r = tables.jobs, tables.ranks
    last_seen = (
        sa.select(r.c.job_id, sa.func.max(r.c.last_seen).label("last_seen"))
        .group_by(r.c.job_id)
        .subquery()
    )
    ended = sa.func.coalesce(j.c.ended_at, last_seen.c.last_seen, j.c.started_at)
    query = (
        sa.select(j.c.job_id)
        .select_from(j.outerjoin(last_seen, last_seen.c.job_id == j.c.job_id))
        .where(ended < before, sa.func.coalesce(last_seen.c.last_seen, 0.0) < before)
        .order_by(j.c.job_id)
    )
    return list(conn.execute(query).scalars())


def prune(engine: sa.Engine, *, before: float, keep_rollups: bool) -> PruneResult:
    """Delete jobs done before `before`: only their raw rows with `keep_rollups` (summaries,
    rollups and findings stay queryable), else everything about them."""
    doomed = RAW_TABLES if keep_rollups else (*RAW_TABLES, *DERIVED_TABLES)
    with engine.begin() as conn:
        job_ids = old_jobs(conn, before)
        result = PruneResult(job_ids=job_ids)
        if not job_ids:
            return result
        state = tables.analysis_state
        for table in doomed:
            deleted = conn.execute(sa.delete(table).where(table.c.job_id.in_(job_ids)))
            result.deleted_rows[table.name] = deleted.rowcount
        if keep_rollups:
            # Marked so that a full re-analysis, which rebuilds rollups from raw rows, refuses.
            states = conn.execute(
                sa.select(state.c.job_id, state.c.state).where(state.c.job_id.in_(job_ids))
            ).all()
            for job_id, doc in states:
                conn.execute(
                    sa.update(state)
                    .where(state.c.job_id == job_id)
                    .values(state={**doc, "raw_pruned_before": before})
                )
    return result
