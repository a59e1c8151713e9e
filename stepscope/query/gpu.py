"""GPU telemetry of a job over time: per device of one rank, or the spread across devices."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl
import sqlalchemy as sa
from numpy.typing import NDArray

from stepscope.analysis import rollups as compute
from stepscope.query.common import check_at_least, require_job
from stepscope.store import frames, reads

METRICS = compute.GPU_SPREAD
"""Per-device means per time bucket (util in %, power in W, temperature in °C, SM MHz)."""
_RAW_COLUMNS = ["rank", "ts", "gpu_index", *METRICS, "mem_used_bytes", "throttle_reasons"]
_MEANS = [f"{m}_mean" for m in METRICS]

Floats = NDArray[np.float64]


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSeries:
    """Telemetry per time bucket [ts, ts + bucket_s).

    With a rank: one row per (gpu_index, bucket) of that rank's devices, `values` holding
    each metric's mean and temp_c_max, sm_clock_mhz_min, mem_used_bytes_max. Without: one
    row per bucket, `values` holding {metric}_min, _p50 and _max across the job's devices
    of their bucket means. throttle_reasons is the OR of the NVML clocks-event reasons.
    """

    rank: int | None
    bucket_s: float
    ts: Floats
    gpu_index: NDArray[np.int64] | None
    num_devices: NDArray[np.int64]
    values: dict[str, Floats]
    throttle_reasons: NDArray[np.int64]


def gpu_series(
    engine: sa.Engine, job_id: str, *, rank: int | None = None, max_points: int = 1000
) -> GpuSeries | None:
    """A job's GPU telemetry in at most max_points time buckets (per device of `rank`, or
    across all devices); None without samples. One rank's series is bucketed from its raw
    samples on the rollup's bucket edges, so it lines up with the across-device spread."""
    check_at_least("max_points", max_points, 2)
    require_job(engine, job_id)
    if rank is not None:
        return _rank_series(engine, job_id, rank, max_points)
    stored = reads.read_gpu_spread(engine, job_id)
    if stored is None:
        return None
    width, spread = stored
    first_ts = spread["first_ts"]
    merged = _coarser(width, float(first_ts.min()), float(first_ts.max()), max_points)  # type: ignore[arg-type]
    if merged > width:  # fewer points than stored: re-bucket each device, then spread them
        spread, width = _coarser_spread(engine, job_id, merged), merged
    names = [f"{m}_{q}" for m in METRICS for q in ("min", "p50", "max")]
    return GpuSeries(
        rank=None,
        bucket_s=width,
        ts=spread["first_ts"].to_numpy(),
        gpu_index=None,
        num_devices=spread["num_devices"].to_numpy(),
        values={n: spread[n].cast(pl.Float64).fill_null(np.nan).to_numpy() for n in names},
        throttle_reasons=spread["throttle_reasons"].fill_null(0).to_numpy(),
    )


def _coarser_spread(engine: sa.Engine, job_id: str, width: float) -> pl.DataFrame:
    """The spread over devices of their means in buckets of `width` (from per-device rows)."""
    needed = ["rank", "gpu_index", "num_samples", *_MEANS, "throttle_reasons"]
    stored = reads.read_gpu_bucket_table(engine, job_id, columns=needed)
    assert stored is not None
    buckets = stored[1]
    unread = [f"{c}_mean" for c in compute.GPU_MEANS if f"{c}_mean" not in buckets.columns]
    unread += ["temp_c_max", "sm_clock_mhz_min", "mem_used_bytes_max"]
    buckets = buckets.with_columns(pl.lit(None, dtype=pl.Float64).alias(c) for c in unread)
    return compute.gpu_spread(compute.merge_gpu_buckets(buckets, width))


def _rank_series(engine: sa.Engine, job_id: str, rank: int, max_points: int) -> GpuSeries | None:
    """One rank's devices, bucketed from its raw samples (a read bounded by that rank)."""
    samples = frames.read_frame(engine, "gpu", job_id, columns=_RAW_COLUMNS, ranks=[rank])
    if samples.is_empty():
        if not reads.rank_seen(engine, job_id, rank):
            raise ValueError(f"rank {rank} has sent nothing for job {job_id!r}")
        return None
    first, last = float(samples["ts"].min()), float(samples["ts"].max())  # type: ignore[arg-type]
    width = reads.gpu_bucket_width(engine, job_id) or compute.bucket_width(first, last)
    width = _coarser(width, first, last, max_points)
    buckets = compute.gpu_buckets(samples, width).sort("gpu_index", "first_ts")
    names = [*_MEANS, "temp_c_max", "sm_clock_mhz_min", "mem_used_bytes_max"]
    return GpuSeries(
        rank=rank,
        bucket_s=width,
        ts=buckets["first_ts"].to_numpy(),
        gpu_index=buckets["gpu_index"].to_numpy(),
        num_devices=np.ones(buckets.height, dtype=np.int64),
        values={
            n.removesuffix("_mean"): buckets[n].cast(pl.Float64).fill_null(np.nan).to_numpy()
            for n in names
        },
        throttle_reasons=buckets["throttle_reasons"].fill_null(0).to_numpy(),
    )


def _coarser(width: float, lo: float, hi: float, max_points: int) -> float:
    """The bucket width, doubled until times lo..hi fall in at most max_points buckets."""
    while math.floor(hi / width) - math.floor(lo / width) + 1 > max_points:
        width *= 2
    return width
