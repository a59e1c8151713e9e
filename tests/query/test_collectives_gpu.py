"""collective_stats and gpu_series equal polars over the raw rows."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from stepscope import query
from tests.query.conftest import JOB, NUM_RANKS, NUM_STEPS, Stored


def test_collective_bandwidth_per_op_and_size_equals_polars(stored: Stored) -> None:
    stats = query.collective_stats(stored.engine, JOB)
    factor = 2 * (NUM_RANKS - 1) / NUM_RANKS  # all_reduce
    per_step = stored.collectives.group_by("step").agg(
        (pl.col("bytes") * factor / pl.col("busy_s")).median().alias("busbw"),
        (pl.col("bytes").median() * factor / pl.col("busy_s").min()).alias("transfer_busbw"),
        (pl.col("bytes").median() / pl.col("busy_s").min()).alias("algbw"),
        (pl.col("bytes") / pl.col("count")).median().alias("per_call"),
    )
    sizes = stats.sizes

    assert sizes.op == ["all_reduce"]
    assert sizes.num_steps.tolist() == [NUM_STEPS]
    per_call = float(per_step["per_call"].median())  # type: ignore[arg-type]
    assert sizes.size_log2.tolist() == [math.floor(math.log2(per_call))]
    for name, column in (
        ("busbw_p50_bps", "busbw"),
        ("transfer_busbw_p50_bps", "transfer_busbw"),
        ("algbw_p50_bps", "algbw"),
    ):
        expected = float(per_step[column].median())  # type: ignore[arg-type]
        assert getattr(sizes, name)[0] == pytest.approx(expected, rel=1e-12)


def test_collective_series_over_steps_keeps_the_extremes(stored: Stored) -> None:
    full = query.collective_stats(stored.engine, JOB, max_points=NUM_STEPS).series[0]
    small = query.collective_stats(stored.engine, JOB, max_points=50).series[0]
    busbw = stored.collectives.with_columns(
        (pl.col("bytes") * 2 * (NUM_RANKS - 1) / NUM_RANKS / pl.col("busy_s")).alias("bw")
    )
    expected = busbw.group_by("step").agg(pl.col("bw").min()).sort("step")

    assert full.op == "all_reduce"
    np.testing.assert_allclose(full.busbw_min_bps, expected["bw"].to_numpy(), rtol=1e-12)
    assert len(small.step) <= 50
    assert small.busbw_min_bps.min() == full.busbw_min_bps.min()
    assert small.busbw_p50_bps.max() == full.busbw_p50_bps.max()


def device_means(stored: Stored, width: float) -> pl.DataFrame:
    """Per (bucket, rank, gpu_index): mean of each metric over the raw samples."""
    bucket = ((pl.col("ts") / width).floor() * width).alias("first_ts")
    return stored.gpu.group_by(bucket, "rank", "gpu_index").agg(
        pl.col("util", "power_w", "temp_c", "sm_clock_mhz").mean(),
        pl.col("throttle_reasons").bitwise_or(),
    )


@pytest.mark.parametrize("max_points", [1000, 50])
def test_gpu_spread_across_devices_equals_polars(stored: Stored, max_points: int) -> None:
    series = query.gpu_series(stored.engine, JOB, max_points=max_points)
    assert series is not None
    assert series.ts.size <= max_points
    expected = (
        device_means(stored, series.bucket_s)
        .group_by("first_ts")
        .agg(
            pl.len().alias("num_devices"),
            pl.col("util").min().alias("util_min"),
            pl.col("power_w").median().alias("power_w_p50"),
            pl.col("sm_clock_mhz").max().alias("sm_clock_mhz_max"),
            pl.col("throttle_reasons").bitwise_or(),
        )
        .sort("first_ts")
    )

    np.testing.assert_allclose(series.ts, expected["first_ts"].to_numpy())
    np.testing.assert_array_equal(series.num_devices, expected["num_devices"].to_numpy())
    for name in ("util_min", "power_w_p50", "sm_clock_mhz_max"):
        np.testing.assert_allclose(series.values[name], expected[name].to_numpy(), rtol=1e-9)
    np.testing.assert_array_equal(
        series.throttle_reasons, expected["throttle_reasons"].fill_null(0).to_numpy()
    )


def test_one_ranks_gpu_series_is_its_devices_bucket_means(stored: Stored) -> None:
    spread = query.gpu_series(stored.engine, JOB)
    series = query.gpu_series(stored.engine, JOB, rank=3, max_points=200)
    assert spread is not None
    assert series is not None
    assert series.ts.size <= 200
    assert series.bucket_s >= spread.bucket_s
    expected = (
        device_means(stored, series.bucket_s)
        .filter(pl.col("rank") == 3)
        .sort("gpu_index", "first_ts")
    )

    np.testing.assert_array_equal(series.gpu_index, expected["gpu_index"].to_numpy())
    np.testing.assert_allclose(series.ts, expected["first_ts"].to_numpy())
    for name in ("util", "power_w", "temp_c", "sm_clock_mhz"):
        np.testing.assert_allclose(series.values[name], expected[name].to_numpy(), rtol=1e-9)
    with pytest.raises(ValueError, match="rank 999"):
        query.gpu_series(stored.engine, JOB, rank=999)
