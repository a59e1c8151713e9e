"""The jobs a store holds: one job's row, and which jobs are sending data."""

from __future__ import annotations

import json
import time
from typing import Any

import sqlalchemy as sa

from stepscope.store import frames, tables


def load_job(engine: sa.Engine, job_id: str) -> dict[str, Any] | None:
    """The jobs row of `job_id` as a dict, or None."""
    with engine.connect() as conn:
        row = (
            conn.execute(sa.select(tables.jobs).where(tables.jobs.c.job_id == job_id))
            .mappings()
            .first()
        )
    return dict(row) if row else None


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


def jobs_between(
    engine: sa.Engine, *, started_before: float, ended_after: float, limit: int
) -> list[tuple[str, str | None]]:
    """(job_id, name) of at most `limit` jobs started before `started_before` that had not
    ended by `ended_after` (or have no end), by id."""
    j = tables.jobs.c
    query = (
        sa.select(j.job_id, j.name)
        .where(j.started_at < started_before)
        .where(sa.or_(j.ended_at.is_(None), j.ended_at >= ended_after))
        .order_by(j.job_id)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [(str(job_id), name) for job_id, name in conn.execute(query)]


def rank_nodes(engine: sa.Engine, job_id: str) -> tuple[dict[int, str], list[int]]:
    """The job's ranks that reported, and the node of each that named one."""
    ranks = frames.read_frame(engine, "ranks", job_id, columns=["rank", "node"])
    named = ranks.drop_nulls("node")
    nodes = dict(zip(named["rank"].to_list(), named["node"].to_list(), strict=True))
    return nodes, ranks["rank"].to_list()


def rank_meshes(engine: sa.Engine, job_id: str) -> dict[int, dict[str, list[int]]]:
    """The DeviceMesh coordinates of the job's ranks that sent them: {dim: [coordinate, size]}."""
    ranks = frames.read_frame(engine, "ranks", job_id, columns=["rank", "mesh"])
    named = ranks.drop_nulls("mesh")
    return {
        int(rank): json.loads(mesh) if isinstance(mesh, str) else mesh
        for rank, mesh in zip(named["rank"].to_list(), named["mesh"].to_list(), strict=True)
    }


LIVE_FIGURES = (
    "step_p50_s",
    "tokens_per_s",
    "mfu",
    "goodput",
    "num_info",
    "num_warning",
    "num_critical",
)
"""The job_summaries columns that `live_job_figures` returns beside job_id and hang."""


def live_job_figures(engine: sa.Engine, *, seen_within_s: float) -> list[dict[str, Any]]:
    """Each job that sent a batch in the last `seen_within_s` seconds: its summary's key
    figures (None before its first analysis pass) and whether it has an open hang finding."""
    r, s, f = tables.ranks, tables.job_summaries, tables.findings
    live = (
        sa.select(r.c.job_id)
        .where(r.c.last_seen >= time.time() - seen_within_s)
        .group_by(r.c.job_id)
        .subquery()
    )
    figures = sa.select(live.c.job_id, *(s.c[c] for c in LIVE_FIGURES)).select_from(
        live.outerjoin(s, s.c.job_id == live.c.job_id)
    )
    hangs = sa.select(f.c.job_id, f.c.evidence).where(
        f.c.kind == "hang", f.c.job_id.in_(sa.select(live.c.job_id))
    )
    with engine.connect() as conn:
        rows = [dict(row) for row in conn.execute(figures).mappings()]
        hanging = {
            job_id
            for job_id, evidence in conn.execute(hangs)
            if _loaded(evidence).get("closed_at") is None
        }
    for row in rows:
        row["hang"] = row["job_id"] in hanging
    return rows


def _loaded(evidence: Any) -> dict[str, Any]:
    """A JSON column's value as a dict (SQLite hands back text on some paths)."""
    if isinstance(evidence, str):
        loaded = json.loads(evidence)
        return loaded if isinstance(loaded, dict) else {}
    return evidence if isinstance(evidence, dict) else {}


def live_rank_names(engine: sa.Engine, *, seen_within_s: float) -> list[dict[str, Any]]:
    """job_id, rank, local_rank, node and attributes of each rank seen in the last
    `seen_within_s` seconds (attributes decoded)."""
    r = tables.ranks
    query = sa.select(r.c.job_id, r.c.rank, r.c.local_rank, r.c.node, r.c.attributes).where(
        r.c.last_seen >= time.time() - seen_within_s
    )
    with engine.connect() as conn:
        rows = [dict(row) for row in conn.execute(query).mappings()]
    for row in rows:
        row["attributes"] = _loaded(row["attributes"]) if row["attributes"] is not None else {}
    return rows


def newest_rank_seen(engine: sa.Engine) -> float | None:
    """When the most recently appeared rank of any job was first seen."""
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.max(tables.ranks.c.first_seen))).scalar()


def rank_gpus(engine: sa.Engine, job_id: str) -> dict[int, str]:
    """The NVML UUID of each rank's GPU, where its profiler sent one (ranks.attributes)."""
    ranks = frames.read_frame(engine, "ranks", job_id, columns=["rank", "attributes"])
    out: dict[int, str] = {}
    for rank, attributes in zip(
        ranks["rank"].to_list(), ranks["attributes"].to_list(), strict=True
    ):
        loaded = json.loads(attributes) if isinstance(attributes, str) else attributes
        uuid = (loaded or {}).get("gpu.uuid")
        if isinstance(uuid, str) and uuid:
            out[int(rank)] = uuid
    return out


def job_names(engine: sa.Engine, job_ids: list[str]) -> dict[str, str | None]:
    """job_id → name of the listed jobs that are stored."""
    j = tables.jobs
    out: dict[str, str | None] = {}
    with engine.connect() as conn:
        for start in range(0, len(job_ids), 500):
            query = sa.select(j.c.job_id, j.c.name).where(
                j.c.job_id.in_(job_ids[start : start + 500])
            )
            out.update({str(r.job_id): r.name for r in conn.execute(query)})
    return out
