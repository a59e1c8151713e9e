"""A job's steady state: per-step job metrics, where warm-up ends, and robust job levels.

The regression gate (stepscope.analysis.regression.gate) treats each job as one sample: its
level is the log of a trimmed mean over the steps after warm-up. Steps inside a job are
autocorrelated, so they are not independent samples; they only give the level and its own
standard error (by batch means, which respect that autocorrelation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl
from numpy.typing import NDArray

from stepscope.analysis.stats.robust import mad_sigma

Floats = NDArray[np.float64]

THROUGHPUT = ("step_s", "tokens_per_s", "mfu")
"""Metrics of how fast the job runs."""
COMPONENTS = ("data_s", "compute_s", "comm_wait_s")
"""The parts of the job's step time, on its critical path."""
METRICS = (*THROUGHPUT, *COMPONENTS)
HIGHER_IS_BETTER = frozenset({"tokens_per_s", "mfu"})

_RATE_WORK = {"tokens_per_s": "tokens", "mfu": "mfu_work"}
"""Rates are work per step over step time: these columns hold their work per step."""


def job_metrics(rollup: pl.DataFrame) -> pl.DataFrame:
    """Per step of a step rollup (stepscope.analysis.rollups.step_rollup, or the stored
    step_rollups): the job's step time and its critical-path components, and work per step.

    In synchronous training every rank ends a step together, after the last rank to reach
    the collective. So the job's step time is step_s_max; its communication is what that last
    rank waits (comm_wait_s_min: pure transfer, no waiting for peers); the rest is that
    rank's own work, split into data (data_s_max) and compute. A straggler then shows as
    compute (or data), not as everyone else's waiting. Steps reported by fewer ranks than
    the median step are left out (a step still arriving).
    """
    frame = rollup.filter(pl.col("num_ranks") >= pl.col("num_ranks").median()).sort("step")
    step_s = pl.col("step_s_max")
    comm = pl.col("comm_wait_s_min") if "comm_wait_s_min" in frame.columns else pl.lit(None)
    mfu = pl.col("mfu") if "mfu" in frame.columns else pl.lit(None)
    return frame.select(
        "step",
        step_s.alias("step_s"),
        pl.col("data_s_max").alias("data_s"),
        (step_s - pl.col("data_s_max") - comm.fill_null(0.0)).alias("compute_s"),
        comm.cast(pl.Float64).alias("comm_wait_s"),
        pl.col("tokens").cast(pl.Float64).alias("tokens"),
        (mfu.cast(pl.Float64) * step_s).alias("mfu_work"),
    )


def detect_warmup(values: Floats, *, batch_steps: int = 5, max_share: float = 0.5) -> int:
    """Leading steps of warm-up in a step-time series: MSER-5 (White, 1997) on the series
    with outliers clipped. The truncation minimises the standard error of the remaining
    mean, so it cuts while the early steps are off the steady level and stops once they are
    not; it cuts at most `max_share` of the series."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    num_batches = x.size // batch_steps
    if num_batches < 4:
        return 0
    tail = x[x.size // 2 :]
    centre = float(np.median(tail))
    sigma = mad_sigma(tail, centre)
    if sigma > 0:  # a one-step spike must not look like a level
        x = np.clip(x, centre - 3 * sigma, centre + 3 * sigma)
    means = x[: num_batches * batch_steps].reshape(num_batches, batch_steps).mean(axis=1)
    # MSER(d) = sum over batches after d of (mean - their mean)^2 / (batches after d)^2
    suffix_n = np.arange(num_batches, 0, -1, dtype=np.float64)
    suffix_sum = np.cumsum(means[::-1])[::-1]
    suffix_sq = np.cumsum((means * means)[::-1])[::-1]
    sse = suffix_sq - suffix_sum * suffix_sum / suffix_n
    allowed = max(1, int(max_share * num_batches))
    mser = sse[:allowed] / suffix_n[:allowed] ** 2
    return int(np.argmin(mser)) * batch_steps


@dataclass(frozen=True, slots=True, kw_only=True)
class Level:
    """A metric's steady-state level in one job, in natural log units."""

    log_value: float
    """log of the trimmed mean (rates: log trimmed mean of work − log trimmed mean of time)."""
    se_log: float
    """Standard error of log_value from the job's own steps (batch means); NaN if too few."""

    @property
    def value(self) -> float:
        return math.exp(self.log_value)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobLevels:
    """A job summarised: warm-up found, steady steps counted, a Level per available metric."""

    job_id: str
    warmup_steps: int
    num_steady_steps: int
    levels: dict[str, Level]


def job_levels(
    job_id: str,
    metrics: pl.DataFrame,
    *,
    warmup_steps: int | None,
    trim: float = 0.1,
    num_batches: int = 20,
) -> JobLevels:
    """Levels of every metric with values in `metrics` (job_metrics), after `warmup_steps`
    leading steps (None: detected from the step-time series)."""
    step_s = metrics["step_s"].to_numpy().astype(np.float64)
    warmup = detect_warmup(step_s) if warmup_steps is None else min(warmup_steps, step_s.size)
    steady = metrics.slice(warmup)
    time_s = steady["step_s"].to_numpy().astype(np.float64)
    levels: dict[str, Level] = {}
    for metric in METRICS:
        work = _RATE_WORK.get(metric)
        numerator = steady[work if work else metric].to_numpy().astype(np.float64)
        denominator = time_s if work else None
        level = _level(numerator, denominator, trim=trim, num_batches=num_batches)
        if level is not None:
            levels[metric] = level
    return JobLevels(
        job_id=job_id, warmup_steps=warmup, num_steady_steps=steady.height, levels=levels
    )


def _level(
    numerator: Floats, denominator: Floats | None, *, trim: float, num_batches: int
) -> Level | None:
    """The Level of numerator (over denominator); None if most steps have no value.

    Its standard error is the trimmed mean's (Tukey and McLaughlin: the winsorized values'
    spread over 1 − 2 trim) with the spread from batch means of consecutive steps, so that
    autocorrelation within the job counts.
    """
    keep = np.isfinite(numerator)
    if denominator is not None:
        keep &= np.isfinite(denominator)
    if keep.sum() < max(2, keep.size // 2):
        return None
    top = trimmed_mean(numerator[keep], trim)
    bottom = 1.0 if denominator is None else trimmed_mean(denominator[keep], trim)
    if not (top > 0 and bottom > 0):
        return None
    # The winsorized ratio's batch means: the level's relative error, ratio and all.
    relative = winsorized(numerator[keep], trim) / top
    if denominator is not None:
        relative = relative - winsorized(denominator[keep], trim) / bottom + 1.0
    size = max(1, relative.size // num_batches)
    batches = relative.size // size
    se = math.nan
    if batches >= 4:
        means = relative[: batches * size].reshape(batches, size).mean(axis=1)
        se = float(np.std(means, ddof=1) / math.sqrt(batches)) / (1.0 - 2.0 * trim)
    return Level(log_value=math.log(top / bottom), se_log=se)


def trimmed_mean(values: Floats, trim: float) -> float:
    """Mean of the values left after dropping the `trim` share at each end."""
    ordered = np.sort(values)
    cut = int(trim * ordered.size)
    kept = ordered[cut : ordered.size - cut] if ordered.size > 2 * cut else ordered
    return float(kept.mean()) if kept.size else math.nan


def winsorized(values: Floats, trim: float) -> Floats:
    """The values with the `trim` share at each end set to the nearest value kept."""
    ordered = np.sort(values)
    cut = int(trim * ordered.size)
    if cut == 0 or ordered.size <= 2 * cut:
        return values
    return np.clip(values, ordered[cut], ordered[ordered.size - cut - 1])
