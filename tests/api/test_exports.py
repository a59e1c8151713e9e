"""Exports through HTTP stream the stored rows and read back equal."""

from __future__ import annotations

import io

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from stepscope import schema
from stepscope.store import frames
from tests.api.conftest import JOB, Api


def stored_steps(api: Api) -> pl.DataFrame:
    rows = frames.read_frame(api.engine, "steps", JOB)
    nodes = frames.read_frame(api.engine, "ranks", JOB, columns=["rank", "node"])
    return rows.join(nodes, on="rank", how="left").select(schema.STEPS.names)


@pytest.mark.parametrize("format", ["parquet", "csv", "ndjson"])
def test_steps_export_round_trips_the_stored_rows(api: Api, format: str) -> None:
    with api.client.stream(
        "GET", f"/jobs/{JOB}/export", params={"table": "steps", "format": format}
    ) as response:
        data = b"".join(response.iter_bytes())
    expected = stored_steps(api)
    if format == "parquet":
        back = pl.read_parquet(io.BytesIO(data))
    elif format == "csv":
        back = pl.read_csv(io.BytesIO(data), schema=expected.schema)
    else:
        back = pl.read_ndjson(io.BytesIO(data), schema=expected.schema)

    assert response.status_code == 200
    assert response.headers["content-type"].startswith(
        {"parquet": "application/vnd.apache.parquet", "csv": "text/csv"}.get(
            format, "application/x-ndjson"
        )
    )
    assert "content-length" not in response.headers  # streamed in chunks
    assert f'filename="{JOB}-steps.{format}"' in response.headers["content-disposition"]
    assert back.columns == list(schema.STEPS.names)
    assert_frame_equal(back, expected)
    assert_frame_equal(
        back.select("rank", "step", "step_s", "tokens"),
        api.steps.select("rank", "step", "step_s", "tokens"),
    )


def test_findings_and_gpu_exports(api: Api) -> None:
    findings = api.client.get(f"/jobs/{JOB}/export", params={"table": "findings"})
    gpu = api.client.get(f"/jobs/{JOB}/export", params={"table": "gpu", "format": "parquet"})

    kinds = pl.read_parquet(io.BytesIO(findings.content))["kind"].to_list()
    assert kinds == [f["kind"] for f in api.client.get(f"/jobs/{JOB}/findings").json()]
    assert pl.read_parquet(io.BytesIO(gpu.content)).height == len(api.job.gpu["ts"])


def test_export_rejects_an_unknown_table_or_format(api: Api) -> None:
    for parameter, params in (("table", {"table": "ranks"}), ("format", {"format": "xlsx"})):
        response = api.client.get(f"/jobs/{JOB}/export", params=params)
        assert response.status_code == 422
        assert response.json()["errors"][0]["parameter"] == parameter


def test_collectives_export_carries_the_per_group_columns(api: Api) -> None:
    response = api.client.get(
        f"/jobs/{JOB}/export", params={"table": "collectives", "format": "csv"}
    )
    like = pl.DataFrame(frames.arrow_schema("collectives").empty_table())
    back = pl.read_csv(io.BytesIO(response.content), schema=like.schema)

    assert response.status_code == 200
    assert back.columns == list(schema.COLLECTIVES.names)
    sent = api.job.collectives
    assert back["group"].to_list() == sent["group"].tolist()
    assert back["first_seq"].to_list() == sent["first_seq"].tolist()
    assert back["wait_s"].to_list() == sent["wait_s"].astype(float).tolist()
    assert back["group_ranks"].to_list() == sent["group_ranks"].tolist()
