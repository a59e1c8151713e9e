"""Series, rank tables, heatmaps, collectives and GPU telemetry equal polars over the rows."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from stepscope.query import decode_values
from stepscope.synthetic.generate import node_name
from tests.api.conftest import JOB, Api
from tests.jobs import NUM_RANKS, NUM_STEPS, RANKS_PER_NODE, STRAGGLER


def per_step(api: Api, expr: pl.Expr) -> pl.DataFrame:
    return api.steps.group_by("step").agg(expr.alias("value")).sort("step")


@pytest.mark.parametrize(
    ("metric", "agg", "expr"),
    [
        ("step_s", "max", pl.col("step_s").max()),
        ("compute_s", "median", pl.col("compute_s").median()),
        ("data_s", "min", pl.col("data_s").min()),
        ("comm_wait_s", "mean", pl.col("comm_wait_s").mean()),
        ("tokens_per_s", "median", pl.col("tokens").sum() / pl.col("step_s").max()),
    ],
)
def test_timeseries_equals_polars_over_the_ingested_rows(
    api: Api, metric: str, agg: str, expr: pl.Expr
) -> None:
    series = api.client.get(f"/jobs/{JOB}/timeseries", params={"metric": metric, "agg": agg})
    body = series.json()
    expected = per_step(api, expr)

    assert series.status_code == 200
    assert body["num_steps"] == NUM_STEPS
    assert body["step"] == expected["step"].to_list()
    np.testing.assert_allclose(body["value"], expected["value"].to_numpy(), rtol=1e-9)


def test_timeseries_of_one_rank_and_a_step_range(api: Api) -> None:
    params = {"metric": "step_s", "rank": STRAGGLER, "from_step": 100, "to_step": 199}
    body = api.client.get(f"/jobs/{JOB}/timeseries", params=params).json()
    raw = api.steps.filter(pl.col("rank") == STRAGGLER, pl.col("step").is_between(100, 199))

    assert body["rank"] == STRAGGLER
    assert body["agg"] is None
    assert body["step"] == raw["step"].to_list()
    np.testing.assert_allclose(body["value"], raw["step_s"].to_numpy(), rtol=1e-12)


def test_timeseries_downsampling_keeps_the_extremes(api: Api) -> None:
    body = api.client.get(
        f"/jobs/{JOB}/timeseries", params={"metric": "step_s", "agg": "max", "max_points": 40}
    ).json()
    full = per_step(api, pl.col("step_s").max())["value"]

    assert len(body["step"]) <= 40
    assert max(body["value"]) == pytest.approx(full.max(), rel=1e-12)
    assert min(body["value"]) == pytest.approx(full.min(), rel=1e-12)


def test_timeseries_rejects_what_does_not_apply(api: Api) -> None:
    cases = {
        "agg": {"metric": "mfu", "agg": "max"},
        "rank": {"rank": 99},
        "max_points": {"max_points": 1},
        "metric": {"metric": "loss"},
    }
    for parameter, params in cases.items():
        response = api.client.get(f"/jobs/{JOB}/timeseries", params=params)
        assert response.status_code == 422, parameter
        assert response.json()["errors"][0]["parameter"] == parameter
        assert parameter in response.json()["detail"]


def test_rank_table_puts_the_straggler_first(api: Api) -> None:
    body = api.client.get(f"/jobs/{JOB}/ranks").json()
    ranks = {r["rank"]: r for r in body["ranks"]}
    medians = api.steps.group_by("rank").agg(pl.col("compute_s").median()).sort("rank")
    findings = {f["id"]: f for f in api.client.get(f"/jobs/{JOB}/findings").json()}

    assert body["bucket_steps"] == 1
    assert body["ranks"][0]["rank"] == STRAGGLER
    assert sorted(ranks) == list(range(NUM_RANKS))
    assert [ranks[r]["node"] for r in range(NUM_RANKS)] == [
        node_name(r // RANKS_PER_NODE) for r in range(NUM_RANKS)
    ]
    np.testing.assert_allclose(
        [ranks[r]["median_s"]["compute_s"] for r in range(NUM_RANKS)],
        medians["compute_s"].to_numpy(),
        rtol=1e-5,
    )
    assert ranks[STRAGGLER]["compute_excess"] > 0.15
    assert sum(r["slowest_share"] for r in body["ranks"]) == pytest.approx(1.0)
    assert any(findings[i]["kind"] == "straggler_rank" for i in ranks[STRAGGLER]["finding_ids"])


def test_heatmap_cells_are_means_of_the_ranks_steps(api: Api) -> None:
    params = {"metric": "compute_s", "max_ranks": NUM_RANKS, "max_steps": 100}
    body = api.client.get(f"/jobs/{JOB}/heatmap", params=params).json()
    values = decode_values(body)
    expected = (
        api.steps.with_columns((pl.col("step") // 4).alias("column"))
        .group_by("rank", "column")
        .agg(pl.col("compute_s").mean())
        .sort("rank", "column")["compute_s"]
        .to_numpy()
        .reshape(NUM_RANKS, 100)
    )
    lo, hi = body["scale"]

    assert body["shape"] == [NUM_RANKS, 100]
    assert body["ranks"] == list(range(NUM_RANKS))
    assert body["step_edges"] == list(range(0, NUM_STEPS + 1, 4))
    np.testing.assert_allclose(values, expected, atol=(hi - lo) / 254 + 1e-6)

    coarse = api.client.get(f"/jobs/{JOB}/heatmap", params={"max_ranks": 2}).json()
    assert coarse["shape"][0] == 2
    assert coarse["nodes"] == [node_name(0), node_name(1)]
    assert coarse["row_starts"] == [0, 4, 8]


def test_collectives_per_op_and_size(api: Api) -> None:
    body = api.client.get(f"/jobs/{JOB}/collectives", params={"max_points": 50}).json()
    spec = api.job.spec
    (size,) = body["sizes"]

    assert size["op"] == "all_reduce"
    assert size["num_steps"] == NUM_STEPS
    assert size["bytes_per_call_p50"] == pytest.approx(spec.allreduce_bytes / spec.num_buckets)
    assert size["size_log2"] == int(np.log2(spec.allreduce_bytes / spec.num_buckets))
    assert size["transfer_busbw_p50_bps"] > 0
    (series,) = body["series"]
    assert len(series["step"]) <= 50
    assert all(
        lo <= hi for lo, hi in zip(series["busbw_min_bps"], series["busbw_p50_bps"], strict=True)
    )


def test_gpu_telemetry_across_devices_and_of_one_rank(api: Api) -> None:
    spread = api.client.get(f"/jobs/{JOB}/gpu", params={"max_points": 20}).json()
    one = api.client.get(f"/jobs/{JOB}/gpu", params={"rank": 3, "max_points": 20}).json()

    assert 0 < len(spread["ts"]) <= 20
    assert spread["gpu_index"] is None
    assert max(spread["num_devices"]) == NUM_RANKS
    assert all(
        lo <= mid <= hi
        for lo, mid, hi in zip(
            spread["values"]["util_min"],
            spread["values"]["util_p50"],
            spread["values"]["util_max"],
            strict=True,
        )
    )
    assert one["rank"] == 3
    assert set(one["gpu_index"]) == {3 % RANKS_PER_NODE}
    assert one["ts"] == sorted(one["ts"])


def test_a_step_range_without_steps_gives_empty_series(api: Api) -> None:
    params = {"from_step": NUM_STEPS + 100}
    series = api.client.get(f"/jobs/{JOB}/timeseries", params=params).json()
    heat = api.client.get(f"/jobs/{JOB}/heatmap", params=params)

    assert (series["step"], series["value"], series["num_steps"]) == ([], [], 0)
    assert heat.status_code == 200
    assert heat.json()["shape"] in ([0, 0], [NUM_RANKS, 0])
