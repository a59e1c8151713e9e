"""Rollups of raw rows (DESIGN §6): per step, per step and op, per rank × step bucket, GPU
per device × time bucket. Pure polars; the store keeps them, the analyzer maintains them.

Every rollup is a function of the raw rows of its key alone, so a late or resent row only
means recomputing its step (or bucket) from raw rows, and a rollup computed in many pieces
equals one computed at once. Buckets are aligned to multiples of their width (a power of two
steps, or seconds), so doubling the width merges pairs of stored buckets exactly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl
from numpy.typing import NDArray

from stepscope.analysis.communication.collectives import (
    group_labels,
    is_constant,
    summed_over_groups,
)
from stepscope.analysis.frames.grid import Grid

Floats = NDArray[np.float64]

METRICS = ("step_s", "data_s", "comm_wait_s", "compute_s")
"""Time components of a step rolled up per step and per rank × step bucket."""

AGGREGATES = ("min", "p50", "p90", "max", "mean")
"""Statistics over ranks of each time component in the step rollup ({metric}_{aggregate})."""
GPU_MEANS = ("util", "power_w", "temp_c", "sm_clock_mhz", "sm_active", "tensor_active")
"""GPU metrics averaged per device and bucket (with temp_c max, sm_clock min, memory max)."""

GPU_BUCKET_COLUMNS = ("rank", "gpu_index", "ts", *GPU_MEANS, "mem_used_bytes", "throttle_reasons")
"""What gpu_buckets reads of the samples."""

MAX_BUCKETS = 1024
"""Buckets per job in the rank × step and GPU rollups; the width doubles as the job grows."""

_WORK = ("tokens", "samples", "flops")


def with_compute(steps: pl.DataFrame) -> pl.DataFrame:
    """Steps with compute_s filled where absent: step_s − data_s − comm_wait_s (0 if unknown)."""
    wait = pl.col("comm_wait_s") if "comm_wait_s" in steps.columns else pl.lit(0.0)
    derived = pl.col("step_s") - pl.col("data_s") - wait.fill_null(0.0)
    compute = pl.col("compute_s").fill_null(derived) if "compute_s" in steps.columns else derived
    missing = [
        pl.lit(None, dtype=pl.Float64).alias(c) for c in ("ts", *METRICS, *_WORK) if c not in steps
    ]
    return steps.with_columns(missing).with_columns(compute.alias("compute_s"))


def step_rollup(
    steps: pl.DataFrame,
    *,
    peak_flops: float | None = None,
    world_size: int | None = None,
    spread: bool = True,
    grid: Grid | None = None,
) -> pl.DataFrame:
    """Per step: ranks reporting, earliest start, min/p50/p90/max/mean of each time component,
    the slowest rank (the lowest of tied ranks), summed work (null where no rank reported it)
    and job MFU (null without a peak).

    Without `spread`, only what the job-level detectors read: the time components' max alone.
    `grid` is the frame's Grid when the caller has it.
    """
    frame = with_compute(steps)
    grid = grid or Grid.of(frame["rank"].to_numpy(), frame["step"].to_numpy())

    def matrix(column: str) -> Floats:
        return np.ascontiguousarray(grid.matrix(frame[column].to_numpy(), dtype=np.float64))

    step_s = matrix("step_s")
    present = ~np.isnan(step_s)
    columns: dict[str, Any] = {
        "step": grid.steps,
        "num_ranks": present.sum(axis=1),
        "ts": _row_stats(matrix("ts"), ("min",))["min"],
    }
    for m in METRICS if spread else ("step_s",):
        stats = _row_stats(
            step_s if m == "step_s" else matrix(m), AGGREGATES if spread else ("max",)
        )
        columns.update({f"{m}_{a}": v for a, v in stats.items()})
    columns["slowest_rank"] = grid.ranks[np.where(present, step_s, -np.inf).argmax(axis=1)]
    for c in _WORK:
        x = matrix(c)
        reported = (~np.isnan(x)).sum(axis=1)
        columns[c] = np.where(reported > 0, np.nansum(x, axis=1), np.nan)
        if c == "flops":
            columns["num_flops_ranks"] = reported
    rollup = (
        pl.DataFrame(columns)
        .fill_nan(None)
        .with_columns(pl.col("tokens", "samples").cast(pl.Int64), pl.col("flops").cast(pl.Float64))
    )
    return rollup.with_columns(mfu(rollup, peak_flops, world_size))


def _row_stats(x: Floats, wanted: tuple[str, ...]) -> dict[str, Floats]:
    """Per row of x, ignoring NaN: min, p50, p90, max (linear interpolation) and mean."""
    n = (~np.isnan(x)).sum(axis=1)
    out: dict[str, Floats] = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        if "min" in wanted:
            out["min"] = np.fmin.reduce(x, axis=1)
        if "max" in wanted:
            out["max"] = np.fmax.reduce(x, axis=1)
        if "mean" in wanted:
            out["mean"] = np.nansum(x, axis=1) / n
        quantiles = [a for a in wanted if a in _LEVELS]
        if quantiles:
            ordered = np.sort(x, axis=1)  # NaN last
            rows = np.arange(x.shape[0])
            for a in quantiles:
                position = np.maximum(n - 1, 0) * _LEVELS[a]
                lo = np.floor(position).astype(np.int64)
                below, above = ordered[rows, lo], ordered[rows, np.ceil(position).astype(np.int64)]
                out[a] = below + (above - below) * (position - lo)
    for values in out.values():
        values[n == 0] = np.nan
    return {a: out[a] for a in wanted}


_LEVELS = {"p50": 0.5, "p90": 0.9}


def mfu(rollup: pl.DataFrame, peak_flops: float | None, world_size: int | None) -> pl.Series:
    """Per step of a step rollup: summed FLOPs / job step time / (peak × ranks); null w/o peak.

    Ranks is `world_size` when given, else the ranks that reported FLOPs in that step.
    """
    if peak_flops is None or not peak_flops > 0:
        return pl.Series("mfu", [None] * rollup.height, dtype=pl.Float64)
    ranks = world_size if world_size is not None else rollup["num_flops_ranks"]
    return (rollup["flops"] / rollup["step_s_max"] / (peak_flops * ranks)).alias("mfu")


def _busbw_factor() -> pl.Expr:
    """stepscope.schema.busbw_factor of each row's op and group size, as an expression."""
    n = pl.col("group_size").cast(pl.Float64)
    op = pl.col("op")
    return (
        pl.when(op == "all_reduce")
        .then(2.0 * (n - 1) / n)
        .when(op.is_in(["all_gather", "reduce_scatter", "all_to_all"]))
        .then((n - 1) / n)
        .when(op == "barrier")
        .then(None)
        .otherwise(1.0)
    )


def op_rollup(
    collectives: pl.DataFrame, *, spread: bool = True, grid: Grid | None = None
) -> pl.DataFrame:
    """Per (step, group label, op): ranks, group size, median calls and bytes over ranks, busy
    time spread, and bus bandwidth (per rank: bytes × factor / busy time) min and median over
    ranks. The label (column `group`) is schema.group_label of the rows' group and mesh
    dimension: every tp group rolls up as "tp", rows without a group as "all"; should a rank
    have rows of one op in two groups of one label, they are summed.

    Without `spread`, only what slow_collective reads (no busy_s p50/max, no busbw). `grid`:
    the Grid of the job's steps, reused for ops whose rows have its layout.
    """
    labels = group_labels(collectives)
    rows = collectives.with_columns(labels.alias("_label"))
    single = is_constant(labels) and is_constant(rows["op"])
    parts = []
    groups = (
        [((labels[0], rows["op"][0]), rows)]
        if single and rows.height
        else sorted(rows.partition_by("_label", "op", as_dict=True).items())
    )
    for (label, op), part in groups:
        part = summed_over_groups(part)
        if spread:
            busbw = pl.col("bytes").cast(pl.Float64) * _busbw_factor() / pl.col("busy_s")
            part = part.with_columns(pl.when(pl.col("busy_s") > 0).then(busbw).alias("_busbw"))
        rank, step = part["rank"].to_numpy(), part["step"].to_numpy()
        placed = None if grid is None else grid.placed(rank, step)
        if placed is not None and placed[1] is None:
            op_grid = placed[0]
        else:
            op_grid = Grid.of(rank, step)

        def matrix(column: str, on: Grid = op_grid, of: pl.DataFrame = part) -> Floats:
            values = of[column].to_numpy()
            return np.ascontiguousarray(on.matrix(values, dtype=np.float64))

        group_size = matrix("group_size")
        columns = {
            "step": op_grid.steps,
            "group": [label] * op_grid.steps.size,
            "op": [op] * op_grid.steps.size,
            "num_ranks": (~np.isnan(group_size)).sum(axis=1),
            "group_size": _row_stats(group_size, ("max",))["max"],
            "count": _row_stats(matrix("count"), ("p50",))["p50"],
            "bytes": _row_stats(matrix("bytes"), ("p50",))["p50"],
        }
        busy = _row_stats(matrix("busy_s"), ("min", "p50", "max") if spread else ("min",))
        columns.update({f"busy_s_{a}": v for a, v in busy.items()})
        if spread:
            bandwidth = _row_stats(matrix("_busbw"), ("min", "p50"))
            columns.update({f"busbw_{a}_bps": v for a, v in bandwidth.items()})
        frame = pl.DataFrame(columns, schema_overrides={"group": pl.String}).fill_nan(None)
        parts.append(frame.with_columns(pl.col("group_size").cast(pl.Int64)))
    if not parts:
        return pl.DataFrame(schema=_OP_ROLLUP_SCHEMA)
    return pl.concat(parts).sort("step", "group", "op")


_OP_ROLLUP_SCHEMA = {
    "step": pl.Int64,
    "group": pl.String,
    "op": pl.String,
    "num_ranks": pl.Int64,
    "group_size": pl.Int64,
    **dict.fromkeys(("count", "bytes", "busy_s_min", "busy_s_p50", "busy_s_max"), pl.Float64),
    "busbw_min_bps": pl.Float64,
    "busbw_p50_bps": pl.Float64,
}


def bucket_width(first: float, last: float, *, unit: float = 1.0) -> float:
    """Smallest power-of-two multiple of `unit` that covers first..last in MAX_BUCKETS buckets."""
    span = max(last - first, 0.0) / unit + 1.0
    return unit * 2.0 ** max(0, math.ceil(math.log2(span / MAX_BUCKETS)))


def _bucket(column: str, width: float) -> pl.Expr:
    start = (pl.col(column) / width).floor() * width
    return start.cast(pl.Int64) if width >= 1 and float(width).is_integer() else start


def rank_buckets(steps: pl.DataFrame, bucket_steps: int) -> pl.DataFrame:
    """Per (first_step of the bucket, rank): sum, count and max of each time component."""
    frame = with_compute(steps)
    return (
        frame.lazy()
        .group_by(_bucket("step", bucket_steps).alias("first_step"), "rank")
        .agg(
            *(
                e
                for m in METRICS
                for e in (
                    pl.col(m).sum().alias(f"{m}_sum"),
                    pl.col(m).count().cast(pl.Int64).alias(f"{m}_count"),
                    pl.col(m).max().alias(f"{m}_max"),
                )
            )
        )
        .sort("first_step", "rank")
        .collect()
    )


def merge_rank_buckets(buckets: pl.DataFrame, bucket_steps: int) -> pl.DataFrame:
    """Rank buckets of a finer width merged into buckets of `bucket_steps` (a multiple of it)."""
    return (
        buckets.lazy()
        .group_by(_bucket("first_step", bucket_steps).alias("first_step"), "rank")
        .agg(
            *(
                e
                for m in METRICS
                for e in (
                    pl.col(f"{m}_sum").sum(),
                    pl.col(f"{m}_count").sum(),
                    pl.col(f"{m}_max").max(),
                )
            )
        )
        .sort("first_step", "rank")
        .collect()
    )


def gpu_buckets(gpu: pl.DataFrame, bucket_s: float) -> pl.DataFrame:
    """Per (first_ts of the bucket, rank, gpu_index): samples, metric means, temp_c max,
    sm_clock_mhz min, mem_used_bytes max and the OR of the throttle reasons."""
    missing = [
        pl.lit(None, dtype=pl.Float64).alias(c)
        for c in (*GPU_MEANS, "mem_used_bytes")
        if c not in gpu.columns
    ]
    if "throttle_reasons" not in gpu.columns:
        missing.append(pl.lit(None, dtype=pl.Int64).alias("throttle_reasons"))
    return (
        gpu.lazy()
        .with_columns(missing)
        .group_by(_bucket("ts", bucket_s).alias("first_ts"), "rank", "gpu_index")
        .agg(
            pl.len().cast(pl.Int64).alias("num_samples"),
            *(pl.col(c).cast(pl.Float64).mean().alias(f"{c}_mean") for c in GPU_MEANS),
            pl.col("temp_c").cast(pl.Float64).max().alias("temp_c_max"),
            pl.col("sm_clock_mhz").cast(pl.Float64).min().alias("sm_clock_mhz_min"),
            pl.col("mem_used_bytes").cast(pl.Float64).max().alias("mem_used_bytes_max"),
            pl.col("throttle_reasons").cast(pl.Int64).bitwise_or().alias("throttle_reasons"),
        )
        .with_columns(pl.col("first_ts").cast(pl.Float64))
        .sort("first_ts", "rank", "gpu_index")
        .collect()
    )


GPU_SPREAD = ("util", "power_w", "temp_c", "sm_clock_mhz")
"""Metrics whose device means are also kept per bucket as their min, p50 and max over devices."""


def gpu_spread(buckets: pl.DataFrame) -> pl.DataFrame:
    """Per first_ts of GPU buckets (gpu_buckets): devices, and the min/p50/max over devices of
    each GPU_SPREAD metric's bucket mean, and the OR of their throttle reasons."""
    return (
        buckets.lazy()
        .group_by("first_ts")
        .agg(
            pl.len().cast(pl.Int64).alias("num_devices"),
            *(
                e
                for m in GPU_SPREAD
                for e in (
                    pl.col(f"{m}_mean").min().alias(f"{m}_min"),
                    pl.col(f"{m}_mean").median().alias(f"{m}_p50"),
                    pl.col(f"{m}_mean").max().alias(f"{m}_max"),
                )
            ),
            pl.col("throttle_reasons").bitwise_or(),
        )
        .sort("first_ts")
        .collect()
    )


def merge_gpu_buckets(buckets: pl.DataFrame, bucket_s: float) -> pl.DataFrame:
    """GPU buckets merged into a coarser width; means weighted by samples."""
    weight = pl.col("num_samples")
    return (
        buckets.lazy()
        .group_by(
            _bucket("first_ts", bucket_s).cast(pl.Float64).alias("first_ts"), "rank", "gpu_index"
        )
        .agg(
            weight.sum(),
            *(
                (
                    (pl.col(f"{c}_mean") * weight).sum()
                    / weight.filter(pl.col(f"{c}_mean").is_not_null()).sum()
                ).alias(f"{c}_mean")
                for c in GPU_MEANS
            ),
            pl.col("temp_c_max").max(),
            pl.col("sm_clock_mhz_min").min(),
            pl.col("mem_used_bytes_max").max(),
            pl.col("throttle_reasons").bitwise_or(),
        )
        .sort("first_ts", "rank", "gpu_index")
        .collect()
    )


def steady_summary(rollup: pl.DataFrame, first_steady_step: int) -> dict[str, float | int | None]:
    """A job's figures from its step rollup, over the steps from `first_steady_step` (all of
    them while there are none yet): step time p50/p90 (the job's, i.e. its slowest rank's),
    median tokens/s, samples/s and MFU, and each time component's share of the ranks' steps."""
    steady = rollup.filter(pl.col("step") >= first_steady_step)
    steady = rollup if steady.is_empty() else steady
    step_s = steady["step_s_max"]
    total_s = float(steady["step_s_mean"].sum())

    def share(metric: str) -> float | None:
        part = steady[f"{metric}_mean"]
        return (
            None if part.null_count() == part.len() or not total_s else float(part.sum()) / total_s
        )

    def median(values: pl.Series) -> float | None:
        value = values.median()
        return None if value is None else float(value)  # type: ignore[arg-type]

    return {
        "num_steps": rollup.height,
        "first_step": int(rollup["step"].min()),  # type: ignore[arg-type]
        "last_step": int(rollup["step"].max()),  # type: ignore[arg-type]
        "step_p50_s": median(step_s),
        "step_p90_s": float(step_s.quantile(0.9, interpolation="linear") or 0.0),
        "tokens_per_s": median(steady["tokens"] / step_s),
        "samples_per_s": median(steady["samples"] / step_s),
        "mfu": median(steady["mfu"]),
        **{f"{m}_share": share(f"{m}_s") for m in ("data", "compute", "comm_wait")},
    }
