"""Hangs going on now (#19): the open `hang` findings the hang monitor keeps, per job."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from stepscope import schema
from stepscope.query.common import check_at_least
from stepscope.query.summary import StoredFinding
from stepscope.store import reads
from stepscope.store.hang_reports import is_open

RECENT_HANGS = 200
"""Hang findings looked at for the jobs list's banner (newest first)."""


def open_hang(findings: Sequence[StoredFinding]) -> StoredFinding | None:
    """A job's open hang among its findings (there is at most one), or None."""
    return next((f for f in reversed(findings) if f.kind == "hang" and is_open(f)), None)


def open_hangs(engine: sa.Engine, *, limit: int = 20) -> list[StoredFinding]:
    """The open hangs of every job, newest first, at most `limit`."""
    check_at_least("limit", limit, 1)
    names = ("id", *schema.FINDINGS.names)
    rows = reads.read_recent_hang_findings(engine, RECENT_HANGS)
    found = [StoredFinding(**{k: row[k] for k in names}) for row in rows]
    return [f for f in found if is_open(f)][:limit]
