"""Hang reports (#19): each rank's latest report, and the job's hang findings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from stepscope import schema
from stepscope.store import tables

REPORT_COLUMNS = tuple(c.name for c in tables.hang_reports.columns)


def upsert_reports(conn: sa.Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Keep each row as its rank's latest report, unless a newer one (by ts) is stored."""
    if not rows:
        return
    t = tables.hang_reports
    insert = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(t)
    excluded = insert.excluded
    statement = insert.on_conflict_do_update(
        index_elements=[t.c.job_id, t.c.rank],
        set_={c: excluded[c] for c in REPORT_COLUMNS if c not in ("job_id", "rank")},
        where=t.c.ts <= excluded.ts,
    )
    conn.execute(statement, [{c: row.get(c) for c in REPORT_COLUMNS} for row in rows])


def load_reports(conn: sa.Connection, job_id: str) -> list[dict[str, Any]]:
    """The job's latest report of each rank, as dicts of the stored columns."""
    t = tables.hang_reports
    rows = conn.execute(sa.select(t).where(t.c.job_id == job_id)).mappings()
    return [dict(row) for row in rows]


def has_reports(conn: sa.Connection, job_id: str) -> bool:
    t = tables.hang_reports
    return (
        conn.execute(sa.select(t.c.rank).where(t.c.job_id == job_id).limit(1)).first() is not None
    )


@dataclass(slots=True)
class StoredHang:
    id: int
    finding: schema.Finding


def hang_findings(conn: sa.Connection, job_id: str) -> list[StoredHang]:
    """The job's hang findings, oldest first."""
    t = tables.findings
    names = schema.FINDINGS.names
    rows = conn.execute(
        sa.select(t).where(t.c.job_id == job_id, t.c.kind == "hang").order_by(t.c.id)
    ).mappings()
    return [StoredHang(row["id"], schema.Finding(**{k: row[k] for k in names})) for row in rows]


def is_open(finding: schema.Finding) -> bool:
    """A hang finding goes on until it is closed (evidence.closed_at)."""
    return (finding.evidence or {}).get("closed_at") is None


def open_hang(conn: sa.Connection, job_id: str) -> StoredHang | None:
    """The job's open hang finding, if any (there is at most one)."""
    found = [h for h in hang_findings(conn, job_id) if is_open(h.finding)]
    return found[-1] if found else None


@dataclass(frozen=True, slots=True)
class HangEnd:
    """How the job's last hang ended: hang reports made before `clock_ts`, or of a stall
    that began before `resumed_ts`, are that hang's."""

    clock_ts: float
    """The job's clock (its newest report) when the hang was closed."""
    resumed_ts: float
    """When progress resumed."""


def last_hang_end(conn: sa.Connection, job_id: str) -> HangEnd | None:
    """How the job's last closed hang ended; None when none was closed."""
    ends = []
    for h in hang_findings(conn, job_id):
        evidence = h.finding.evidence or {}
        resumed_ts = evidence.get("resumed_ts")
        clock_ts = evidence.get("closed_clock_ts", resumed_ts)
        if not is_open(h.finding) and clock_ts is not None:
            ends.append(HangEnd(clock_ts, resumed_ts if resumed_ts is not None else clock_ts))
    return max(ends, key=lambda e: e.clock_ts) if ends else None


def save_hang(conn: sa.Connection, finding: schema.Finding, finding_id: int | None) -> int:
    """Store a new hang finding (finding_id None) or replace a stored one; its id."""
    t = tables.findings
    row = finding.to_dict()
    if finding_id is None:
        result = conn.execute(sa.insert(t).values(**row).returning(t.c.id))
        return int(result.scalar_one())
    conn.execute(sa.update(t).where(t.c.id == finding_id).values(**row))
    return finding_id
