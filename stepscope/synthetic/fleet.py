"""Synthetic fleets: many jobs over a shared set of nodes, a few of them chronically slow.

Each job lands on a random subset of the fleet's nodes; each of its ranks' own time per
step bucket (data + compute, what `stepscope.analysis.fleet.node_levels` reads) is

    base × job level × rank bias × node factor × job-node noise × bucket noise

where the node factor is > 1 on the slow nodes, the job-node noise is log-normal with
`job_noise` (a node's interaction with a job) and, now and then (`one_off_prob`), a node is
slow in one job only (`one_off_factor`). Used by tests and benchmarks/fleet_health.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import polars as pl
import sqlalchemy as sa
from numpy.typing import NDArray

from stepscope.analysis.fleet.node_levels import job_levels
from stepscope.store import node_levels
from stepscope.synthetic.generate import node_name


@dataclass(kw_only=True, slots=True)
class FleetSpec:
    """A fleet and its jobs."""

    num_nodes: int = 64
    num_jobs: int = 200
    slow_nodes: dict[int, float] = field(default_factory=lambda: {7: 1.03, 23: 1.06, 51: 1.10})
    """Node number → its own-time factor in every job (1.05: 5 % slow)."""
    slow_from_job: dict[int, int] = field(default_factory=dict)
    """Slow node → the first job it is slow in (default: every job)."""
    slow_until_job: dict[int, int] = field(default_factory=dict)
    """Slow node → the first job it is no longer slow in (repaired; default: never)."""
    one_job_slow: tuple[tuple[int, int, float], ...] = ()
    """(node, job, factor): a node slow in that job only (on top of the random one-offs)."""
    nodes_per_job: tuple[int, ...] = (2, 4, 8, 16)
    """Job sizes in nodes, drawn uniformly."""
    ranks_per_node: int = 8
    num_buckets: int = 40
    """Step buckets per job (the rank × step rollup's columns)."""
    base_own_s: float = 0.45
    job_noise: float = 0.01
    """Log-sd of a node's interaction with a job."""
    one_off_prob: float = 0.02
    """Chance that a (job, node) is slow in that job only."""
    one_off_factor: tuple[float, float] = (1.03, 1.2)
    """Range of such a one-off slowdown."""
    rank_bias: float = 0.005
    bucket_noise: float = 0.01
    start_ts: float = 1.75e9
    job_interval_s: float = 1800.0
    seed: int = 0

    def __post_init__(self) -> None:
        if max(self.nodes_per_job) > self.num_nodes or min(self.nodes_per_job) < 1:
            raise ValueError("nodes_per_job must be in 1..num_nodes")
        if any(not 0 <= n < self.num_nodes for n in self.slow_nodes):
            raise ValueError("slow node outside the fleet")

    def factor(self, node: int, job: int) -> float:
        """The chronic own-time factor of node number `node` in job number `job`."""
        slow = self.slow_nodes.get(node, 1.0)
        on = self.slow_from_job.get(node, 0) <= job < self.slow_until_job.get(node, self.num_jobs)
        return slow if on else 1.0


@dataclass(kw_only=True, slots=True)
class FleetJob:
    """One generated job: where its ranks ran and their own time per step bucket."""

    job_id: str
    ts: float
    nodes: list[str]
    """Host of each rank."""
    gpus: list[str]
    """GPU UUID of each rank (host and local rank make it)."""
    own_s: NDArray[np.float64]
    """(buckets × ranks) mean own time per step."""


def fleet_jobs(spec: FleetSpec) -> Iterator[FleetJob]:
    """The fleet's jobs, oldest first."""
    rng = np.random.default_rng(spec.seed)
    bias = 1.0 + spec.rank_bias * rng.standard_normal((spec.num_nodes, spec.ranks_per_node))
    for j in range(spec.num_jobs):
        size = int(rng.choice(spec.nodes_per_job))
        placed = rng.choice(spec.num_nodes, size=size, replace=False)
        factor = np.array([spec.factor(int(n), j) for n in placed])
        factor *= np.exp(spec.job_noise * rng.standard_normal(size))
        one_off = rng.random(size) < spec.one_off_prob
        factor[one_off] *= rng.uniform(*spec.one_off_factor, size=int(one_off.sum()))
        for node, job, slow in spec.one_job_slow:
            if job == j and node in placed:
                factor[list(placed).index(node)] *= slow
        per_rank = np.repeat(factor, spec.ranks_per_node) * bias[placed].ravel()
        level = spec.base_own_s * rng.uniform(0.7, 1.4)
        noise = np.exp(spec.bucket_noise * rng.standard_normal((spec.num_buckets, per_rank.size)))
        hosts = [node_name(int(n)) for n in placed for _ in range(spec.ranks_per_node)]
        gpus = [
            f"GPU-{int(n):04d}-{i % spec.ranks_per_node}"
            for n in placed
            for i in range(spec.ranks_per_node)
        ]
        yield FleetJob(
            job_id=f"fleet-{j:05d}",
            ts=spec.start_ts + j * spec.job_interval_s,
            nodes=hosts,
            gpus=gpus,
            own_s=level * per_rank[None, :] * noise,
        )


def fleet_levels(spec: FleetSpec, *, with_gpus: bool = False) -> pl.DataFrame:
    """Every job's node levels (`job_levels`, GPU rows with `with_gpus`), with job_id and ts."""
    parts = []
    for job in fleet_jobs(spec):
        ranks = np.arange(len(job.nodes), dtype=np.int64)
        levels = job_levels(
            job.own_s,
            ranks,
            dict(enumerate(job.nodes)),
            dict(enumerate(job.gpus)) if with_gpus else None,
        )
        parts.append(levels.with_columns(job_id=pl.lit(job.job_id), ts=pl.lit(job.ts)))
    return pl.concat(parts)


def write_fleet(engine: sa.Engine, levels: pl.DataFrame, *, now: float | None = None) -> None:
    """Store `fleet_levels` output as if each job had been analysed: a finished jobs row and
    its node_levels rows, in one transaction."""
    now = time.time() if now is None else now
    per_job = levels.group_by("job_id", maintain_order=True).agg(
        pl.col("ts").first(), pl.col("num_ranks").filter(pl.col("gpu") == "").sum()
    )
    job_rows = [
        {
            "job_id": j["job_id"],
            "name": f"fleet job {j['job_id']}",
            "world_size": int(j["num_ranks"]),
            "started_at": j["ts"],
            "ended_at": j["ts"] + 600.0,
            "status": "finished",
        }
        for j in per_job.to_dicts()
    ]
    level_rows = levels.with_columns(updated_at=pl.lit(now)).to_dicts()
    with engine.begin() as conn:
        node_levels.insert_rows(conn, job_rows, level_rows)


def slow_node_names(spec: FleetSpec) -> dict[str, float]:
    """Host name → injected relative effect (factor − 1) of the chronically slow nodes."""
    return {node_name(n): f - 1.0 for n, f in spec.slow_nodes.items()}
