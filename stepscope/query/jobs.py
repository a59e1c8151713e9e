"""The jobs list: filters, sort and keyset (cursor) pagination over jobs and their summaries."""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from stepscope import schema
from stepscope.query.common import check_at_least, check_choice
from stepscope.store import reads

SORT_KEYS = reads.JOB_SORT_KEYS
"""What `list_jobs` sorts by; a leading "-" sorts descending. Ties are broken by job_id."""
STATUSES = reads.JOB_STATUSES
MAX_LIMIT = 1000
STALE_AFTER_S = 600.0
"""A running job that sent no batch for this long is stale."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFilters:
    """Which jobs `list_jobs` returns; every given filter must hold."""

    status: tuple[str, ...] = ()
    """Any of these statuses (STATUSES); empty: any."""
    benchmark_key: str | None = None
    name_contains: str | None = None
    """A substring of the name, case-insensitive (wildcards are plain characters)."""
    started_after: float | None = None
    """Started at or after this time (epoch s)."""
    started_before: float | None = None
    """Started before this time (epoch s)."""
    min_severity: str | None = None
    """Has a finding of at least this severity (info < warning < critical)."""

    def __post_init__(self) -> None:
        for status in self.status:
            check_choice("status", status, STATUSES)
        if self.min_severity is not None:
            check_choice("min_severity", self.min_severity, schema.SEVERITIES)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRow:
    """One job of the list; summary figures and finding counts are None before analysis."""

    job_id: str
    name: str | None
    benchmark_key: str | None
    status: str
    world_size: int | None
    num_nodes: int | None
    started_at: float | None
    ended_at: float | None
    last_seen: float | None
    step_p50_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    num_info: int | None
    num_warning: int | None
    num_critical: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class JobsPage:
    """A page of jobs and the cursor of the next page (None on the last)."""

    jobs: list[JobRow]
    next_cursor: str | None


def list_jobs(
    engine: sa.Engine,
    filters: JobFilters | None = None,
    *,
    sort: str = "-started_at",
    cursor: str | None = None,
    limit: int = 50,
    stale_after_s: float = STALE_AFTER_S,
) -> JobsPage:
    """A page of the jobs that pass `filters`, in `sort` order, after `cursor`."""
    filters = filters or JobFilters()
    key = sort.removeprefix("-")
    check_choice("sort", key, SORT_KEYS)
    check_at_least("limit", limit, 1)
    if limit > MAX_LIMIT:
        raise ValueError(f"limit must be <= {MAX_LIMIT}; got {limit}")
    query = reads.JobQuery(
        statuses=filters.status,
        benchmark_key=filters.benchmark_key,
        name_contains=filters.name_contains,
        started_after=filters.started_after,
        started_before=filters.started_before,
        min_severity=filters.min_severity,
        sort=key,
        descending=sort.startswith("-"),
        after=None if cursor is None else decode_cursor(cursor, sort),
        limit=limit + 1,
        stale_before=time.time() - stale_after_s,
    )
    rows = reads.read_jobs(engine, query)
    page = [_job_row(r) for r in rows[:limit]]
    last = rows[limit - 1] if len(rows) > limit else None
    return JobsPage(
        jobs=page,
        next_cursor=None if last is None else encode_cursor(sort, last[key], last["job_id"]),
    )


def _job_row(row: dict[str, Any]) -> JobRow:
    """A JobRow of a `reads.read_jobs` row."""
    return JobRow(**{name: row[name] for name in JobRow.__dataclass_fields__})


def encode_cursor(sort: str, value: Any, job_id: str) -> str:
    """An opaque cursor: the sort and the last row's sort value and job_id."""
    doc = json.dumps({"sort": sort, "value": value, "job_id": job_id}, separators=(",", ":"))
    return base64.urlsafe_b64encode(doc.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, sort: str) -> tuple[Any, str]:
    """(sort value, job_id) of a cursor from `encode_cursor` with the same sort."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        doc = json.loads(base64.urlsafe_b64decode(padded.encode()))
        value, job_id, made_for = doc["value"], doc["job_id"], doc["sort"]
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise ValueError("cursor is not one that list_jobs returned") from exc
    if made_for != sort or not isinstance(job_id, str):
        raise ValueError(f"cursor was made for sort {made_for!r}, not {sort!r}")
    return value, job_id
