"""A pass's GPU time buckets: widened as the job's time span grows, and the buckets its new
samples touched recomputed (stepscope.analysis.rollups.gpu_buckets)."""

from __future__ import annotations

import math
from functools import partial

import polars as pl
import sqlalchemy as sa

from stepscope.analysis import rollups as compute
from stepscope.pipeline.state import AnalysisState, Write, widen
from stepscope.store import frames, jobs, rollup_tables

_GPU_RANKS_PER_READ = 64
"""Ranks whose GPU samples a full pass reads and buckets at a time."""


def update_gpu_buckets(
    engine: sa.Engine,
    job_id: str,
    state: AnalysisState,
    first_ts: float,
    last_ts: float | None,
    *,
    stored: bool,
) -> list[Write]:
    """The changes that bring the job's GPU buckets up to date with samples first_ts..last_ts
    (their times widen `state`); `stored`: the job has committed buckets to merge when the
    width grows."""
    state.first_gpu_ts, state.last_gpu_ts = widen(
        state.first_gpu_ts, state.last_gpu_ts, first_ts, last_ts
    )
    assert state.first_gpu_ts is not None
    assert state.last_gpu_ts is not None
    writes: list[Write] = []
    width = compute.bucket_width(state.first_gpu_ts, state.last_gpu_ts)
    if width > state.gpu_bucket_s:
        writes.append(partial(rollup_tables.delete_gpu_buckets, job_id=job_id))
        previous = rollup_tables.read_gpu_buckets(engine, job_id) if stored else None
        if previous is not None:
            merged = compute.merge_gpu_buckets(previous[1], width)
            spread = compute.gpu_spread(merged)
            writes.append(_write(job_id, width, merged, spread))
        state.gpu_bucket_s = width
    w = state.gpu_bucket_s
    if first_ts <= state.first_gpu_ts:  # from the job's first sample: read them all
        # a few ranks at a time along the key (a time-range read of a whole job goes
        # through the ts index, row by row), bucketed as they come
        ranks = jobs.rank_nodes(engine, job_id)[1]
        if not ranks:  # samples come with their rank's first batch
            return writes
        buckets = pl.concat(
            [
                compute.gpu_buckets(
                    frames.read_frame(
                        engine,
                        "gpu",
                        job_id,
                        columns=compute.GPU_BUCKET_COLUMNS,
                        ranks=ranks[i : i + _GPU_RANKS_PER_READ],
                    ),
                    w,
                )
                for i in range(0, len(ranks), _GPU_RANKS_PER_READ)
            ]
        ).sort("first_ts", "rank", "gpu_index")
    else:
        samples = frames.read_frame(
            engine,
            "gpu",
            job_id,
            columns=compute.GPU_BUCKET_COLUMNS,
            from_ts=math.floor(first_ts / w) * w,
            to_ts=(math.floor((last_ts or first_ts) / w) + 1) * w,
        )
        buckets = compute.gpu_buckets(samples, w)
    writes.append(_write(job_id, w, buckets, compute.gpu_spread(buckets)))
    return writes


def _write(job_id: str, width: float, buckets: pl.DataFrame, spread: pl.DataFrame) -> Write:
    return partial(
        rollup_tables.write_gpu_buckets,
        job_id=job_id,
        bucket_s=width,
        buckets=buckets,
        spread=spread,
    )
