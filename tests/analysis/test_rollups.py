"""Rollups equal direct computations over the raw rows, in one piece or many."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from stepscope.analysis import rollups
from stepscope.schema import COLLECTIVE_OPS, busbw_factor
from stepscope.synthetic.generate import JobSpec, Straggler, generate, to_frames


@pytest.fixture(scope="module")
def frames() -> dict[str, pl.DataFrame]:
    spec = JobSpec(
        job_id="r",
        num_ranks=8,
        num_steps=120,
        stragglers=(Straggler(ranks=(5,), factor=1.3, cause="compute", from_step=40),),
        seed=3,
    )
    frames = to_frames(generate(spec))
    assert "compute_s" not in frames["steps"].columns  # the rollups derive it
    return frames


def _compute_s(steps: pl.DataFrame) -> pl.Series:
    return steps["step_s"] - steps["data_s"] - steps["comm_wait_s"]


def test_step_rollup_equals_a_group_by_over_ranks(frames: dict[str, pl.DataFrame]) -> None:
    steps = frames["steps"]
    rollup = rollups.step_rollup(steps, peak_flops=1e15, world_size=8)

    at = steps.filter(pl.col("step") == 77)
    row = rollup.filter(pl.col("step") == 77).row(0, named=True)
    assert row["num_ranks"] == 8
    assert row["step_s_min"] == at["step_s"].min()
    assert row["step_s_max"] == at["step_s"].max()
    assert row["step_s_p50"] == pytest.approx(float(np.median(at["step_s"].to_numpy())))
    assert row["compute_s_p90"] == pytest.approx(float(np.quantile(_compute_s(at).to_numpy(), 0.9)))
    assert row["data_s_mean"] == pytest.approx(at["data_s"].mean())
    assert row["slowest_rank"] == at.sort("step_s")["rank"][-1]
    assert row["tokens"] == at["tokens"].sum()
    assert row["mfu"] == pytest.approx(at["flops"].sum() / at["step_s"].max() / (1e15 * 8))
    assert rollup.height == 120


def test_step_rollup_derives_compute_and_keeps_missing_work_null() -> None:
    steps = pl.DataFrame(
        {"rank": [0, 1], "step": [3, 3], "step_s": [1.0, 2.0], "data_s": [0.25, 0.5]}
    )
    (row,) = rollups.step_rollup(steps).to_dicts()
    assert (row["compute_s_min"], row["compute_s_max"]) == (0.75, 1.5)
    assert (row["tokens"], row["flops"], row["mfu"], row["ts"]) == (None, None, None, None)
    assert row["slowest_rank"] == 1


def test_a_rollup_in_pieces_equals_the_rollup_at_once(frames: dict[str, pl.DataFrame]) -> None:
    steps = frames["steps"]
    pieces = [
        rollups.step_rollup(steps.filter(pl.col("step").is_between(lo, lo + 29)))
        for lo in range(0, 120, 30)
    ]
    assert pl.concat(pieces).equals(rollups.step_rollup(steps))


def test_op_rollup_takes_medians_spread_and_bus_bandwidth(
    frames: dict[str, pl.DataFrame],
) -> None:
    collectives = frames["collectives"]
    rollup = rollups.op_rollup(collectives)

    at = collectives.filter(pl.col("step") == 50)
    row = rollup.filter(pl.col("step") == 50).row(0, named=True)
    factor = busbw_factor("all_reduce", 8)
    busbw = at["bytes"].to_numpy() * factor / at["busy_s"].to_numpy()
    assert (row["op"], row["num_ranks"], row["group_size"]) == ("all_reduce", 8, 8)
    assert row["busy_s_min"] == at["busy_s"].min()
    assert row["bytes"] == float(np.median(at["bytes"].to_numpy()))
    assert row["busbw_min_bps"] == pytest.approx(busbw.min())
    assert row["busbw_p50_bps"] == pytest.approx(float(np.median(busbw)))


@pytest.mark.parametrize("op", COLLECTIVE_OPS)
def test_op_rollup_uses_the_schema_bus_bandwidth_factor(op: str) -> None:
    rows = pl.DataFrame(
        {
            "rank": [0],
            "step": [0],
            "op": [op],
            "group_size": [4],
            "count": [1],
            "bytes": [1000],
            "busy_s": [0.5],
        }
    )
    (row,) = rollups.op_rollup(rows).to_dicts()
    expected = busbw_factor(op, 4) * 2000.0
    assert row["busbw_p50_bps"] == (None if op == "barrier" else pytest.approx(expected))


def test_rank_buckets_merge_exactly_into_coarser_buckets(
    frames: dict[str, pl.DataFrame],
) -> None:
    steps = frames["steps"]
    fine = rollups.rank_buckets(steps, 4)
    direct = rollups.rank_buckets(steps, 16)
    merged = rollups.merge_rank_buckets(fine, 16)

    assert merged.select("first_step", "rank").equals(direct.select("first_step", "rank"))
    for column in direct.columns[2:]:
        assert np.allclose(merged[column].to_numpy(), direct[column].to_numpy()), column
    row = direct.filter((pl.col("first_step") == 48) & (pl.col("rank") == 5)).row(0, named=True)
    own = steps.filter((pl.col("rank") == 5) & pl.col("step").is_between(48, 63))
    assert row["step_s_count"] == 16
    assert row["step_s_sum"] == pytest.approx(own["step_s"].sum())
    assert row["compute_s_max"] == pytest.approx(_compute_s(own).max())


def test_gpu_buckets_average_and_merge_weighted_by_samples(
    frames: dict[str, pl.DataFrame],
) -> None:
    gpu = frames["gpu"]
    direct = rollups.gpu_buckets(gpu, 8.0)
    merged = rollups.merge_gpu_buckets(rollups.gpu_buckets(gpu, 2.0), 8.0)

    assert merged["num_samples"].sum() == gpu.height
    assert np.allclose(merged["power_w_mean"].to_numpy(), direct["power_w_mean"].to_numpy())
    assert merged["throttle_reasons"].to_list() == direct["throttle_reasons"].to_list()
    first = direct.row(0, named=True)
    own = gpu.filter(
        (pl.col("rank") == first["rank"])
        & (pl.col("ts") >= first["first_ts"])
        & (pl.col("ts") < first["first_ts"] + 8.0)
    )
    assert first["num_samples"] == own.height
    assert first["temp_c_max"] == pytest.approx(own["temp_c"].max())


@pytest.mark.parametrize(
    ("first", "last", "width"), [(0, 1023, 1), (0, 1024, 2), (0, 9999, 16), (500, 600, 1)]
)
def test_bucket_width_is_the_smallest_power_of_two_within_the_bucket_limit(
    first: int, last: int, width: float
) -> None:
    assert rollups.bucket_width(first, last) == width
    assert (last - first + 1) / width <= rollups.MAX_BUCKETS


def test_steady_summary_skips_the_warm_up(frames: dict[str, pl.DataFrame]) -> None:
    rollup = rollups.step_rollup(frames["steps"])
    summary = rollups.steady_summary(rollup, first_steady_step=20)

    steady = rollup.filter(pl.col("step") >= 20)
    assert summary["num_steps"] == 120
    assert summary["step_p50_s"] == pytest.approx(steady["step_s_max"].median())
    shares = [summary[f"{m}_share"] for m in ("data", "compute", "comm_wait")]
    assert sum(s for s in shares if s is not None) == pytest.approx(1.0)
