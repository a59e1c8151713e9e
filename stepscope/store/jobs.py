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
