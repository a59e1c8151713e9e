"""A pass's update of its job's node and GPU levels (what fleet health reads)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from stepscope.analysis.fleet.node_levels import job_levels, own_time_matrix
from stepscope.store import jobs, node_levels, rollup_tables

_STATS = ("data_s_sum", "compute_s_sum", "compute_s_count")


def update_node_levels(
    engine: sa.Engine, conn: sa.Connection, job_id: str, job: dict[str, Any], now: float
) -> None:
    """Recompute the job's levels from its rank buckets as `conn` sees them, and store them."""
    buckets = rollup_tables.read_rank_buckets(conn, job_id, stats=_STATS)
    if buckets is None:
        return
    own_s = own_time_matrix(
        {"data_s": buckets.stats["data_s_sum"], "compute_s": buckets.stats["compute_s_sum"]},
        buckets.stats["compute_s_count"],
    )
    nodes = jobs.rank_nodes(engine, job_id)[0]
    levels = job_levels(own_s, buckets.ranks, nodes, jobs.rank_gpus(engine, job_id))
    started = job.get("started_at")
    node_levels.replace_job_levels(conn, job_id, levels, started, now)
