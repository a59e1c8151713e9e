"""Per-step series of a job (from its step rollups, or one rank's raw rows), downsampled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import sqlalchemy as sa
from numpy.typing import NDArray

from stepscope.analysis.rollups import with_compute
from stepscope.query.common import check_at_least, check_choice, require_job
from stepscope.query.downsample import band_indices, finite, series_indices
from stepscope.store import frames, reads, tables

RANK_METRICS = tables.ROLLUP_METRICS
"""Time components of a step, aggregated over ranks per step."""
AGGREGATES = (*tables.ROLLUP_AGGREGATES, "median")
"""Aggregates over ranks; median is p50."""
JOB_METRICS = ("tokens_per_s", "samples_per_s", "mfu", "num_ranks")
"""Job-level per-step metrics (no aggregate): rates over the job's step time (its slowest rank)."""
METRICS = (*RANK_METRICS, *JOB_METRICS)
_DEFAULT_AGG = "p50"


@dataclass(frozen=True, slots=True, kw_only=True)
class Series:
    """Values of a metric over steps (steps without a value left out), at most max_points."""

    metric: str
    agg: str | None
    """The aggregate over ranks; None for job-level metrics and one rank's values."""
    rank: int | None
    step: NDArray[np.int64]
    value: NDArray[np.float64]
    num_steps: int
    """Steps with a value before downsampling."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Band:
    """Min, median and max across ranks of a time component per step, for the same steps."""

    metric: str
    step: NDArray[np.int64]
    min: NDArray[np.float64]
    p50: NDArray[np.float64]
    max: NDArray[np.float64]
    num_steps: int


def step_series(
    engine: sa.Engine,
    job_id: str,
    metric: str,
    agg: str = _DEFAULT_AGG,
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    max_points: int = 2000,
    rank: int | None = None,
) -> Series:
    """A metric over steps from the step rollups (or, with `rank`, that rank's raw rows),
    downsampled with MinMaxLTTB to at most max_points keeping the global min and max."""
    check_choice("metric", metric, METRICS)
    check_choice("agg", agg, AGGREGATES)
    check_at_least("max_points", max_points, 2)
    agg = "p50" if agg == "median" else agg
    if (metric in JOB_METRICS or rank is not None) and agg != _DEFAULT_AGG:
        raise ValueError(f"agg applies to {', '.join(RANK_METRICS)} across ranks only; omit it")
    if rank is not None and metric == "num_ranks":
        raise ValueError("metric num_ranks has no per-rank values; omit rank")
    job = require_job(engine, job_id)
    if rank is not None:
        steps, values = _rank_values(engine, job, metric, rank, from_step, to_step)
        if steps.size == 0 and not reads.rank_seen(engine, job_id, rank):
            raise ValueError(f"rank {rank} has sent nothing for job {job_id!r}")
    else:
        steps, values = _rollup_values(engine, job_id, metric, agg, from_step, to_step)
    keep = finite(values)
    steps, values = steps[keep], values[keep]
    picked = series_indices(steps, values, max_points)
    return Series(
        metric=metric,
        agg=agg if metric in RANK_METRICS and rank is None else None,
        rank=rank,
        step=steps[picked],
        value=values[picked],
        num_steps=int(steps.size),
    )


def step_band(
    engine: sa.Engine,
    job_id: str,
    metric: str = "step_s",
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    max_points: int = 2000,
) -> Band:
    """Min / median / max across ranks per step, downsampled at indices chosen once on the
    max and min series (their global max and min kept)."""
    check_choice("metric", metric, RANK_METRICS)
    check_at_least("max_points", max_points, 2)
    require_job(engine, job_id)
    columns = ["step", *(f"{metric}_{q}" for q in ("min", "p50", "max"))]
    frame = reads.read_rollup(
        engine, tables.step_rollups, job_id, columns=columns, from_step=from_step, to_step=to_step
    )
    steps = frame["step"].to_numpy()
    lo, mid, hi = (frame[c].to_numpy().astype(np.float64) for c in columns[1:])
    keep = finite(lo, mid, hi)
    steps, lo, mid, hi = steps[keep], lo[keep], mid[keep], hi[keep]
    picked = band_indices(steps, lo, hi, max_points)
    return Band(
        metric=metric,
        step=steps[picked],
        min=lo[picked],
        p50=mid[picked],
        max=hi[picked],
        num_steps=int(steps.size),
    )


def _rollup_values(
    engine: sa.Engine,
    job_id: str,
    metric: str,
    agg: str,
    from_step: int | None,
    to_step: int | None,
) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    if metric in RANK_METRICS:
        value = pl.col(f"{metric}_{agg}")
    elif metric in ("tokens_per_s", "samples_per_s"):
        value = pl.col(metric.removesuffix("_per_s")) / pl.col("step_s_max")
    else:
        value = pl.col(metric)
    frame = reads.read_rollup(
        engine,
        tables.step_rollups,
        job_id,
        columns=["step", *value.meta.root_names()],
        from_step=from_step,
        to_step=to_step,
    )
    return _arrays(frame.select("step", value.cast(pl.Float64).alias("value")))


def _rank_values(
    engine: sa.Engine,
    job: dict[str, Any],
    metric: str,
    rank: int,
    from_step: int | None,
    to_step: int | None,
) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """One rank's raw per-step values (a read bounded by that rank's steps)."""
    needed = {
        "compute_s": ["step_s", "data_s", "comm_wait_s", "compute_s"],
        "tokens_per_s": ["tokens", "step_s"],
        "samples_per_s": ["samples", "step_s"],
        "mfu": ["flops", "step_s"],
    }.get(metric, [metric])
    raw = frames.read_frame(
        engine,
        "steps",
        str(job["job_id"]),
        columns=["step", *needed],
        ranks=[rank],
        from_step=from_step,
        to_step=to_step,
    )
    peak = job.get("peak_flops")
    if metric == "compute_s":
        value = with_compute(raw)["compute_s"]
    elif metric in ("tokens_per_s", "samples_per_s"):
        value = raw[needed[0]] / raw["step_s"]
    elif metric == "mfu":
        unknown = pl.Series([None] * raw.height, dtype=pl.Float64)  # no MFU without a peak
        value = raw["flops"] / raw["step_s"] / float(peak) if peak else unknown
    else:
        value = raw[metric]
    return _arrays(raw.select("step", value.cast(pl.Float64).alias("value")))


def _arrays(frame: pl.DataFrame) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    values = frame["value"].fill_null(np.nan).to_numpy()
    return frame["step"].to_numpy().astype(np.int64), values.astype(np.float64)
