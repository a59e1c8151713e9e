"""A job's findings: replaced as a whole by a pass, read back in the order stored."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from stepscope import schema
from stepscope.store import tables
from stepscope.store.rollup_tables import Connectable, connection


def replace_findings(conn: sa.Connection, job_id: str, findings: Iterable[schema.Finding]) -> int:
    """Make `findings` the job's findings; a finding seen before keeps its first detected_at.

    Hang findings are not the pass's: they are kept (stepscope.store.hang_reports owns them)."""
    t = tables.findings
    now = time.time()
    ours = sa.and_(t.c.job_id == job_id, t.c.kind != "hang")
    previous = {
        _finding_key(row): row["detected_at"]
        for row in conn.execute(sa.select(t).where(ours)).mappings()
    }
    conn.execute(sa.delete(t).where(ours))
    rows = []
    for finding in findings:
        row = finding.to_dict()
        row["detected_at"] = previous.get(_finding_key(row), row["detected_at"] or now)
        rows.append(row)
    if rows:
        conn.execute(sa.insert(t), rows)
    return len(rows)


def _finding_key(row: Any) -> tuple[Any, ...]:
    return (row["kind"], tuple(row["ranks"] or ()), row["node"], row["first_step"], row["metric"])


def load_findings(db: Connectable, job_id: str) -> list[schema.Finding]:
    """The job's stored findings, in the order they were stored."""
    t = tables.findings
    names = schema.FINDINGS.names
    with connection(db) as conn:
        rows = conn.execute(sa.select(t).where(t.c.job_id == job_id).order_by(t.c.id)).mappings()
        return [schema.Finding(**{k: row[k] for k in names}) for row in rows]
