"""What the demo loads beside its real job, so that every view has something to show: a large
synthetic job (the rank × step heatmap at 1,024 ranks) and a small fleet (the Fleet page)."""

from __future__ import annotations

import time
from dataclasses import replace

import polars as pl
import sqlalchemy as sa

from stepscope.pipeline.job_pass import analyze_stored_job
from stepscope.schema import Finding
from stepscope.store import jobs
from stepscope.synthetic.fleet import FleetSpec, fleet_levels, write_fleet
from stepscope.synthetic.generate import JobSpec, SlowNode, Straggler, generate
from stepscope.synthetic.stream import store_rounds

LARGE_RANKS = 1024
LARGE_STEPS = 100
LARGE_RANKS_PER_NODE = 8
LARGE_HOSTS = tuple(f"large-{n:04d}" for n in range(LARGE_RANKS // LARGE_RANKS_PER_NODE))
"""The large job's nodes: a cluster of its own. On the fleet's node-0000, … its one healthy
job would outweigh a slow node's few slow ones and hide it from the Fleet page."""


def large_job_spec(job_id: str, *, now: float) -> JobSpec:
    """1,024 ranks on 128 nodes (LARGE_HOSTS), 100 steps of 0.5 s that ended `now`: a compute
    straggler from step 40 and a node (8 ranks) with slow data from step 60."""
    return JobSpec(
        job_id=job_id,
        num_ranks=LARGE_RANKS,
        num_steps=LARGE_STEPS,
        ranks_per_node=LARGE_RANKS_PER_NODE,
        hosts=LARGE_HOSTS,
        start_ts=now - LARGE_STEPS * 0.5,
        stragglers=(Straggler(ranks=(700,), factor=1.3, cause="compute", from_step=40),),
        slow_nodes=(SlowNode(node=37, factor=1.2, cause="data", from_step=60),),
        with_gpu=False,
    )


def load_large_job(engine: sa.Engine, job_id: str) -> list[Finding]:
    """Store the large job (through the collector's validator and writer), then analyse it."""
    for _ in store_rounds(
        engine, generate(large_job_spec(job_id, now=time.time())), steps_per_batch=50
    ):
        pass
    return analyze_stored_job(engine, job_id)


FLEET = FleetSpec(
    num_nodes=24,
    num_jobs=40,
    slow_nodes={11: 1.08, 17: 1.12},
    nodes_per_job=(2, 4, 8),
    job_interval_s=900.0,
)
"""A fleet of 24 nodes that ran 40 jobs over the last 10 hours; node-0011 and node-0017 are
chronically slow. Each ran 8 or more of the jobs: a node slow in 3 (node-0005 here) is below
fleet health's confidence once the large job's 128 nodes are tested beside it."""


FLEET_PREFIX = "demo-"
"""The fleet's job ids are demo-fleet-00000, ...: loaded once per database."""


def load_fleet(engine: sa.Engine) -> int:
    """Store the fleet's jobs as analysed (their node levels), the last one ending now, unless
    an earlier demo stored them in this database; how many jobs were stored."""
    if jobs.load_job(engine, f"{FLEET_PREFIX}fleet-00000") is not None:
        return 0
    now = time.time()
    spec = replace(FLEET, start_ts=now - FLEET.num_jobs * FLEET.job_interval_s)
    levels = fleet_levels(spec, with_gpus=True)
    write_fleet(
        engine, levels.with_columns((FLEET_PREFIX + pl.col("job_id")).alias("job_id")), now=now
    )
    return spec.num_jobs
