"""The synthetic jobs the api, dashboard and query tests share, and their rows as frames."""

from __future__ import annotations

import time

import polars as pl

from stepscope.analysis.rollups import with_compute
from stepscope.synthetic.generate import JobSpec, Straggler, SynthJob, generate, to_frames

NUM_RANKS = 8
RANKS_PER_NODE = 4
NUM_STEPS = 400
STRAGGLER = 5
"""The rank slowed 1.3× in compute from STRAGGLER_FROM on."""
STRAGGLER_FROM = 200


def straggler_job(
    job_id: str,
    *,
    num_ranks: int = NUM_RANKS,
    num_steps: int = NUM_STEPS,
    straggler_from: int = STRAGGLER_FROM,
    start_ts: float | None = None,
    seed: int = 3,
) -> SynthJob:
    """A job of RANKS_PER_NODE ranks a node, without spikes, whose rank STRAGGLER is slowed."""
    return generate(
        JobSpec(
            job_id=job_id,
            num_ranks=num_ranks,
            ranks_per_node=RANKS_PER_NODE,
            num_steps=num_steps,
            spike_prob=0.0,
            stragglers=(
                Straggler(
                    ranks=(STRAGGLER,), factor=1.3, cause="compute", from_step=straggler_from
                ),
            ),
            start_ts=time.time() - num_steps * 0.5 if start_ts is None else start_ts,
            seed=seed,
        )
    )


def step_rows(job: SynthJob) -> pl.DataFrame:
    """The job's step rows as generated, as float64, with compute_s derived as the rollups do."""
    steps = to_frames(job)["steps"]
    floats = [column for column, dtype in steps.schema.items() if dtype.is_float()]
    return with_compute(steps.with_columns(pl.col(floats).cast(pl.Float64)))
