"""Read queries and the few row-wise writes (tokens, findings) the services need."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import polars as pl
import sqlalchemy as sa

from stepscope import schema
from stepscope.store import frames, tables


def load_frame(engine: sa.Engine, name: str, job_id: str) -> pl.DataFrame:
    """One stored table of a job ('steps', 'collectives', 'gpu', 'events', 'ranks')."""
    frame = frames.read_frame(engine, name, job_id)
    # read_frame orders gpu samples by (rank, gpu_index, ts); this frame keeps (rank, ts)
    return frame.sort("rank", "ts", maintain_order=True) if name == "gpu" else frame


def load_job(engine: sa.Engine, job_id: str) -> dict[str, Any] | None:
    """The jobs row of `job_id` as a dict, or None."""
    with engine.connect() as conn:
        row = (
            conn.execute(sa.select(tables.jobs).where(tables.jobs.c.job_id == job_id))
            .mappings()
            .first()
        )
    return dict(row) if row else None


def load_job_frames(engine: sa.Engine, job_id: str) -> dict[str, pl.DataFrame]:
    """Steps (with node from `ranks`), collectives, gpu and ranks frames of a job, for analysis."""
    frames = {
        name: load_frame(engine, name, job_id) for name in ("steps", "collectives", "gpu", "ranks")
    }
    frames["steps"] = frames["steps"].join(
        frames["ranks"].select("rank", "node"), on="rank", how="left"
    )
    return frames


def active_jobs(engine: sa.Engine, *, seen_within_s: float) -> dict[str, float]:
    """Jobs with a batch received in the last `seen_within_s` seconds → when the last arrived."""
    r = tables.ranks
    query = (
        sa.select(r.c.job_id, sa.func.max(r.c.last_seen))
        .where(r.c.last_seen >= time.time() - seen_within_s)
        .group_by(r.c.job_id)
    )
    with engine.connect() as conn:
        return {job_id: float(last_seen) for job_id, last_seen in conn.execute(query)}


def replace_findings(engine: sa.Engine, job_id: str, findings: Iterable[schema.Finding]) -> int:
    """Make `findings` the job's findings; a finding seen before keeps its first detected_at."""
    t = tables.findings
    now = time.time()
    with engine.begin() as conn:
        previous = {
            _finding_key(row): row["detected_at"]
            for row in conn.execute(sa.select(t).where(t.c.job_id == job_id)).mappings()
        }
        conn.execute(sa.delete(t).where(t.c.job_id == job_id))
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


def load_findings(engine: sa.Engine, job_id: str) -> list[schema.Finding]:
    t = tables.findings
    names = schema.FINDINGS.names
    with engine.connect() as conn:
        rows = conn.execute(sa.select(t).where(t.c.job_id == job_id).order_by(t.c.id)).mappings()
        return [schema.Finding(**{k: row[k] for k in names}) for row in rows]


# --- API tokens -------------------------------------------------------------------------

TOKEN_PREFIX = "ss_"


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(engine: sa.Engine, *, name: str, scopes: Iterable[str]) -> str:
    """Store a new token's hash and return the token (shown to the user once)."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with engine.begin() as conn:
        conn.execute(
            sa.insert(tables.ApiToken).values(
                name=name,
                token_sha256=token_sha256(token),
                scopes=" ".join(sorted(set(scopes))),
                created_at=datetime.now(UTC),
            )
        )
    return token


def token_scopes(engine: sa.Engine, token: str) -> frozenset[str] | None:
    """Scopes of a valid, unrevoked token; None if unknown."""
    t = tables.ApiToken
    query = sa.select(t.scopes).where(t.token_sha256 == token_sha256(token), t.revoked_at.is_(None))
    with engine.connect() as conn:
        scopes = conn.execute(query).scalar_one_or_none()
    return None if scopes is None else frozenset(scopes.split())
