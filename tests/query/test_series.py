"""step_series and step_band equal polars over the raw rows; downsampling keeps extremes."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from stepscope import query
from tests.query.conftest import JOB, NUM_RANKS, NUM_STEPS, SPIKE, Stored


def per_step(stored: Stored, expr: pl.Expr) -> pl.DataFrame:
    """Per step of the raw rows: `expr` aggregated over ranks, as `value`."""
    return stored.steps.group_by("step").agg(expr.alias("value")).sort("step")


AGGS = {
    "min": lambda m: pl.col(m).min(),
    "p50": lambda m: pl.col(m).quantile(0.5, interpolation="linear"),
    "median": lambda m: pl.col(m).median(),
    "p90": lambda m: pl.col(m).quantile(0.9, interpolation="linear"),
    "max": lambda m: pl.col(m).max(),
    "mean": lambda m: pl.col(m).mean(),
}


@pytest.mark.parametrize("metric", ["step_s", "compute_s", "data_s", "comm_wait_s"])
@pytest.mark.parametrize("agg", list(AGGS))
def test_series_across_ranks_equals_polars_over_the_raw_rows(
    stored: Stored, metric: str, agg: str
) -> None:
    series = query.step_series(stored.engine, JOB, metric, agg, max_points=NUM_STEPS)
    expected = per_step(stored, AGGS[agg](metric))

    assert series.num_steps == NUM_STEPS
    np.testing.assert_array_equal(series.step, expected["step"].to_numpy())
    np.testing.assert_allclose(series.value, expected["value"].to_numpy(), rtol=1e-12)


def test_job_level_series_are_work_over_the_job_step_time(stored: Stored) -> None:
    step_max = pl.col("step_s").max()
    tokens = query.step_series(stored.engine, JOB, "tokens_per_s", max_points=NUM_STEPS)
    expected = per_step(stored, pl.col("tokens").sum() / step_max)
    np.testing.assert_allclose(tokens.value, expected["value"].to_numpy(), rtol=1e-12)

    mfu = query.step_series(stored.engine, JOB, "mfu", max_points=NUM_STEPS)
    peak = stored.job["peak_flops"] * NUM_RANKS
    expected = per_step(stored, pl.col("flops").sum() / step_max / peak)
    np.testing.assert_allclose(mfu.value, expected["value"].to_numpy(), rtol=1e-12)

    ranks = query.step_series(stored.engine, JOB, "num_ranks", max_points=NUM_STEPS)
    assert set(ranks.value.tolist()) == {NUM_RANKS}


def test_downsampling_keeps_the_global_min_max_and_the_spike(stored: Stored) -> None:
    full = query.step_series(stored.engine, JOB, "step_s", "max", max_points=NUM_STEPS)
    for max_points in (2, 3, 7, 100, 500):
        small = query.step_series(stored.engine, JOB, "step_s", "max", max_points=max_points)

        assert len(small.step) <= max_points
        assert small.num_steps == NUM_STEPS
        assert small.value.max() == full.value.max()
        assert small.value.min() == full.value.min()
        assert SPIKE[1] in small.step.tolist()
        # every kept point is a point of the full series, in step order
        at = np.searchsorted(full.step, small.step)
        np.testing.assert_array_equal(full.step[at], small.step)
        np.testing.assert_array_equal(full.value[at], small.value)
        assert np.all(np.diff(small.step) > 0)
    assert len(query.step_series(stored.engine, JOB, "step_s", max_points=500).step) == 500


def test_step_range_limits_the_series(stored: Stored) -> None:
    series = query.step_series(stored.engine, JOB, "step_s", "p90", from_step=100, to_step=199)
    expected = per_step(stored, AGGS["p90"]("step_s")).filter(pl.col("step").is_between(100, 199))
    np.testing.assert_array_equal(series.step, np.arange(100, 200))
    np.testing.assert_allclose(series.value, expected["value"].to_numpy(), rtol=1e-12)


@pytest.mark.parametrize("metric", ["step_s", "compute_s", "tokens_per_s", "mfu"])
def test_one_rank_series_is_its_raw_rows(stored: Stored, metric: str) -> None:
    rank = 5
    series = query.step_series(
        stored.engine, JOB, metric, rank=rank, from_step=50, to_step=849, max_points=1000
    )
    rows = stored.steps.filter(pl.col("rank") == rank, pl.col("step").is_between(50, 849))
    expected = {
        "step_s": rows["step_s"],
        "compute_s": rows["compute_s"],
        "tokens_per_s": rows["tokens"] / rows["step_s"],
        "mfu": rows["flops"] / rows["step_s"] / stored.job["peak_flops"],
    }[metric]

    assert series.rank == rank
    assert series.agg is None
    np.testing.assert_array_equal(series.step, rows["step"].to_numpy())
    np.testing.assert_allclose(series.value, expected.to_numpy(), rtol=1e-12)


def test_band_is_min_median_max_at_the_same_steps(stored: Stored) -> None:
    band = query.step_band(stored.engine, JOB, "step_s", max_points=NUM_STEPS)
    expected = stored.steps.group_by("step").agg(
        pl.col("step_s").min().alias("min"),
        pl.col("step_s").median().alias("p50"),
        pl.col("step_s").max().alias("max"),
    )
    expected = expected.sort("step")
    for edge in ("min", "p50", "max"):
        np.testing.assert_allclose(getattr(band, edge), expected[edge].to_numpy(), rtol=1e-12)

    small = query.step_band(stored.engine, JOB, "step_s", max_points=60)
    assert len(small.step) <= 60
    assert small.max.max() == band.max.max()
    assert small.min.min() == band.min.min()
    assert SPIKE[1] in small.step.tolist()
    at = np.searchsorted(band.step, small.step)
    for edge in ("min", "p50", "max"):
        np.testing.assert_array_equal(getattr(band, edge)[at], getattr(small, edge))


def test_bad_series_arguments_name_the_argument_and_the_choices(stored: Stored) -> None:
    e = stored.engine
    with pytest.raises(ValueError, match=r"metric must be one of step_s, data_s"):
        query.step_series(e, JOB, "speed")
    with pytest.raises(ValueError, match=r"agg must be one of min, p50"):
        query.step_series(e, JOB, "step_s", "p99")
    with pytest.raises(ValueError, match="max_points must be >= 2"):
        query.step_series(e, JOB, "step_s", max_points=1)
    with pytest.raises(ValueError, match="agg applies to"):
        query.step_series(e, JOB, "mfu", "max")
    with pytest.raises(ValueError, match="rank 999"):
        query.step_series(e, JOB, "step_s", rank=999)
    with pytest.raises(ValueError, match="metric must be one of"):
        query.step_band(e, JOB, "mfu")
