"""Goodput inside steps (docs/goodput.md): a step's GPU-time split into productive compute,
data, exposed communication, straggler wait, and the excess of warm-up (compilation) or of
a stall (hang) over the ideal step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import polars as pl

from stepscope.schema import GOODPUT_CATEGORIES

Floats = np.ndarray[Any, np.dtype[np.float64]]

STEP_COLUMNS = (
    "step",
    "ts",
    "num_ranks",
    "step_s_sum",
    "step_s_max",
    "data_s_sum",
    "comm_wait_s_sum",
    "transfer_s_sum",
)
"""Per step, over the ranks counted: the sums of each time component, the slowest rank's step
time, and transfer_s_sum: the group's transfer time (the least any rank waited) × ranks."""


@dataclass(kw_only=True, slots=True)
class GoodputConfig:
    warmup_steps: int = 10
    """Most leading steps of an incarnation whose excess over the ideal step is compilation."""
    warmup_factor: float = 1.5
    """A leading step is warm-up while the job's step time exceeds the ideal by this factor."""
    stall_factor: float = 10.0
    """A step this many times the job's typical step time holds a stall (hang)..."""
    min_stall_s: float = 10.0
    """...and exceeds it by at least this many seconds."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.warmup_factor < 1 or self.stall_factor < 1:
            raise ValueError("warmup_steps >= 0, warmup_factor >= 1 and stall_factor >= 1")


def job_steps(rollup: pl.DataFrame) -> pl.DataFrame:
    """STEP_COLUMNS from a step rollup (stepscope.analysis.rollups.step_rollup's columns)."""
    n = pl.col("num_ranks").cast(pl.Float64)
    wait_mean = pl.col("comm_wait_s_mean").fill_null(0.0)
    return rollup.select(
        "step",
        "ts",
        "num_ranks",
        (pl.col("step_s_mean") * n).alias("step_s_sum"),
        "step_s_max",
        (pl.col("data_s_mean").fill_null(0.0) * n).alias("data_s_sum"),
        (wait_mean * n).alias("comm_wait_s_sum"),
        (pl.col("comm_wait_s_min").fill_null(0.0) * n).alias("transfer_s_sum"),
    ).sort("step")


def rank_steps(steps: pl.DataFrame) -> pl.DataFrame:
    """Per (rank, step) STEP_COLUMNS of raw step rows; the transfer time is the least any rank
    of the step waited (the last to arrive waits only for the transfer)."""
    wait = pl.col("comm_wait_s").fill_null(0.0) if "comm_wait_s" in steps else pl.lit(0.0)
    return (
        steps.with_columns(wait.alias("comm_wait_s_sum"))
        .with_columns(
            pl.col("comm_wait_s_sum").min().over("step").alias("transfer_s_sum"),
            pl.col("step_s").max().over("step").alias("step_s_max"),
        )
        .select(
            "rank",
            "step",
            "ts",
            pl.lit(1, dtype=pl.Int64).alias("num_ranks"),
            pl.col("step_s").alias("step_s_sum"),
            "step_s_max",
            pl.col("data_s").fill_null(0.0).alias("data_s_sum"),
            "comm_wait_s_sum",
            "transfer_s_sum",
        )
        .sort("rank", "step")
    )


def ideal_step_s(steps: pl.DataFrame) -> tuple[float, float]:
    """(Ideal per-rank step time, typical job step time): medians over the steps."""
    if steps.height == 0:
        return math.nan, math.nan
    per_rank = steps["step_s_sum"] / steps["num_ranks"].cast(pl.Float64)
    return float(per_rank.median()), float(steps["step_s_max"].median())  # type: ignore[arg-type]


def step_split(
    kept: pl.DataFrame,
    ideal: tuple[float, float],
    hangs: Sequence[tuple[float, float]],
    config: GoodputConfig,
) -> dict[str, Floats]:
    """Per kept step (in `kept`'s order), its GPU-seconds by category: data, exposed comm,
    straggler wait and compute; the excess of a warm-up step over the ideal is compilation, of
    a stalled step hang (the rest scaled alike). `ideal`: (ideal per-rank, typical job) step."""
    ideal_s, typical_max_s = ideal
    n = kept["num_ranks"].to_numpy().astype(np.float64)
    step_sum = kept["step_s_sum"].to_numpy().astype(np.float64)
    step_max = kept["step_s_max"].to_numpy().astype(np.float64)
    data = kept["data_s_sum"].to_numpy().astype(np.float64)
    wait = kept["comm_wait_s_sum"].to_numpy().astype(np.float64)
    transfer = np.minimum(kept["transfer_s_sum"].to_numpy().astype(np.float64), wait)
    ts = kept["ts"].to_numpy().astype(np.float64)
    by_finding = np.zeros(ts.shape, dtype=bool)
    for start, _detected in hangs:
        by_finding |= (ts <= start) & (ts + step_max > start + 1e-3) & (step_max > typical_max_s)
    # The first slow steps of an incarnation are warm-up, however slow, unless a hang was
    # detected in them: a 10-minute first-step compile is not a stall.
    warm = np.zeros(ts.shape, dtype=bool)
    for i in np.argsort(ts)[: config.warmup_steps]:
        if step_max[i] <= config.warmup_factor * typical_max_s or by_finding[i]:
            break
        warm[i] = True
    stalled = by_finding | (
        ~warm
        & (step_max >= config.stall_factor * typical_max_s)
        & (step_max - typical_max_s >= config.min_stall_s)
    )
    excess = np.where(
        (warm | stalled) & (step_sum > 0),
        np.clip(1.0 - n * ideal_s / np.where(step_sum > 0, step_sum, 1.0), 0.0, 1.0),
        0.0,
    )
    keep = 1.0 - excess
    return {
        "compile": excess * step_sum * warm,
        "hang": excess * step_sum * stalled,
        "data": keep * data,
        "exposed_comm": keep * transfer,
        "straggler_wait": keep * (wait - transfer),
        "productive": keep * (step_sum - data - wait),
    }


def rerun_split(
    earlier: pl.DataFrame,
    n: int,
    rerun_s: float,
    ideal: tuple[float, float],
    config: GoodputConfig,
) -> dict[str, float]:
    """Steps run again whose rows the store holds from their earlier run: `rerun_s` GPU-seconds
    of kept progress by n ranks, split as the earlier run's time was (a stall in them is hang
    again); beyond what the earlier run took, the excess is warm-up (compilation)."""
    rerun_s = max(0.0, rerun_s)
    out: dict[str, float] = dict.fromkeys(GOODPUT_CATEGORIES, 0.0)
    per_rank = earlier.with_columns(
        (pl.col(c) / pl.col("num_ranks") * n).alias(c)
        for c in ("step_s_sum", "data_s_sum", "comm_wait_s_sum", "transfer_s_sum")
    ).with_columns(pl.lit(n).alias("num_ranks"))
    before = {
        c: float(v.sum())
        for c, v in step_split(per_rank, ideal, (), replace(config, warmup_steps=0)).items()
    }
    before_s = sum(before.values())
    if before_s <= 0:
        out["productive"] = rerun_s
        return out
    out["compile"] = max(0.0, rerun_s - before_s)
    scale = min(rerun_s, before_s) / before_s
    for c, v in before.items():
        out[c] += v * scale
    return out
