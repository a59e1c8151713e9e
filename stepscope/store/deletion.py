"""Deleting one job and everything derived from it."""

from __future__ import annotations

import sqlalchemy as sa

from stepscope.store.retention import DERIVED_TABLES, RAW_TABLES


def delete_job(engine: sa.Engine, job_id: str) -> dict[str, int]:
    """Delete the job's rows from every table in one transaction; rows deleted per table."""
    deleted: dict[str, int] = {}
    with engine.begin() as conn:
        for table in (*RAW_TABLES, *DERIVED_TABLES):
            result = conn.execute(sa.delete(table).where(table.c.job_id == job_id))
            deleted[table.name] = result.rowcount
    return deleted
