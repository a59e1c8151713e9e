"""Exports stream the stored rows in the canonical schema and read back equal."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from stepscope import query, schema
from stepscope.query import exports
from stepscope.store import frames
from tests.query.conftest import EVENTS, JOB, NUM_STEPS, Stored


def stored_steps(stored: Stored) -> pl.DataFrame:
    """The job's stored step rows with each rank's node, in the canonical column order."""
    rows = frames.read_frame(stored.engine, "steps", JOB)
    nodes = frames.read_frame(stored.engine, "ranks", JOB, columns=["rank", "node"])
    return rows.join(nodes, on="rank", how="left").select(schema.STEPS.names)


def read_back(data: bytes, format: str, like: pl.DataFrame) -> pl.DataFrame:
    if format == "parquet":
        return pl.read_parquet(io.BytesIO(data))
    if format == "csv":
        return pl.read_csv(io.BytesIO(data), schema=like.schema)
    return pl.read_ndjson(io.BytesIO(data), schema=like.schema)


@pytest.mark.parametrize("format", ["parquet", "csv", "ndjson"])
def test_steps_export_reads_back_equal_to_the_stored_rows(
    stored: Stored, format: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exports, "BATCH_ROWS", 5000)  # several batches, streamed one by one
    monkeypatch.setattr(exports, "TEXT_CHUNK_ROWS", 1500)  # csv, ndjson: a batch in 4 pieces
    chunks = list(query.export(stored.engine, JOB, "steps", format))
    expected = stored_steps(stored)

    assert len(chunks) > (2 if format == "parquet" else 8)
    back = read_back(b"".join(chunks), format, expected)
    assert back.columns == list(schema.STEPS.names)
    assert_frame_equal(back, expected)
    assert_frame_equal(
        back.select("rank", "step", "step_s"),
        stored.steps.select(back.select("rank", "step", "step_s").columns),
    )


def test_collectives_and_gpu_exports_hold_every_row(stored: Stored) -> None:
    for table, raw in (("collectives", stored.collectives), ("gpu", stored.gpu)):
        data = b"".join(query.export(stored.engine, JOB, table, "parquet"))
        back = pl.read_parquet(io.BytesIO(data))
        assert back.height == raw.height
        assert back.columns == list(schema.TABLES[frames.FRAME_TABLES[table].name].names)


@pytest.mark.parametrize("format", ["parquet", "csv", "ndjson"])
def test_collectives_export_carries_the_per_group_columns(stored: Stored, format: str) -> None:
    data = b"".join(query.export(stored.engine, JOB, "collectives", format))
    like = pl.DataFrame(frames.arrow_schema("collectives").empty_table())
    back = read_back(data, format, like)

    assert back.columns == list(schema.COLLECTIVES.names)
    columns = ["rank", "step", "group", "op", "busy_s", "wait_s", "first_seq", "group_ranks"]
    expected = stored.collectives.select(columns).with_columns(pl.col("wait_s").cast(pl.Float64))
    assert_frame_equal(back.select(columns), expected)
    assert back["mesh_dim"].null_count() == back.height  # the simulator's group spans no mesh
    rank_1_step_3 = back.row(NUM_STEPS + 3, named=True)
    assert (rank_1_step_3["group"], rank_1_step_3["first_seq"]) == ("0", 3 * 25)
    assert rank_1_step_3["group_ranks"] == "0-15"
    assert rank_1_step_3["wait_s"] == rank_1_step_3["busy_s"]


def test_findings_export_keeps_json_columns(stored: Stored) -> None:
    found = query.findings(stored.engine, JOB)
    parquet = pl.read_parquet(
        io.BytesIO(b"".join(query.export(stored.engine, JOB, "findings", "parquet")))
    )
    ndjson = b"".join(query.export(stored.engine, JOB, "findings", "ndjson")).decode()

    assert parquet.columns == list(schema.FINDINGS.names)
    assert parquet["kind"].to_list() == [f.kind for f in found]
    assert pl.read_ndjson(io.BytesIO(ndjson.encode()))["ranks"].to_list() == [
        f.ranks for f in found
    ]
    assert parquet["ranks"].str.json_decode().to_list() == [f.ranks for f in found]


@pytest.mark.parametrize("format", ["parquet", "csv", "ndjson"])
def test_events_export_keeps_messages_and_attributes(stored: Stored, format: str) -> None:
    data = b"".join(query.export(stored.engine, JOB, "events", format))
    like = pl.DataFrame(schema={c.name: pl.String for c in schema.EVENTS.columns}).with_columns(
        pl.col("rank").cast(pl.Int64), pl.col("ts").cast(pl.Float64)
    )
    if format == "ndjson":
        rows = [json.loads(line) for line in data.decode().splitlines()]
        assert [r["attributes"] for r in rows] == [
            e.get("attributes", {}) for e in EVENTS
        ]  # stored as {} when absent
        return
    back = read_back(data, format, like)
    assert back.columns == list(schema.EVENTS.names)
    assert back["ts"].to_list() == [e["ts"] for e in EVENTS]
    assert back["kind"].to_list() == ["restart", "xid"]
    assert back["message"].to_list() == [e["message"] for e in EVENTS]
    attributes = [None if a is None else json.loads(a) for a in back["attributes"]]
    assert attributes == [e.get("attributes", {}) for e in EVENTS]  # stored as {} when absent


def test_export_checks_its_arguments_before_streaming(stored: Stored) -> None:
    with pytest.raises(ValueError, match="table must be one of steps"):
        query.export(stored.engine, JOB, "ranks", "csv")
    with pytest.raises(ValueError, match="format must be one of parquet, csv, ndjson"):
        query.export(stored.engine, JOB, "steps", "xlsx")


def test_a_download_stopped_early_stops_its_read_ahead_and_read_errors_reach_the_client(
    stored: Stored, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exports, "BATCH_ROWS", 1000)
    chunks = query.export(stored.engine, JOB, "steps", "csv")
    assert next(chunks).startswith(b'"job_id","rank","step"')
    chunks.close()  # the client went away
    assert not [t for t in threading.enumerate() if t.name == "stepscope-export-read"]

    original = frames.iter_batches

    def failing(*args: Any, **kwargs: Any) -> Iterator[object]:
        yield from original(*args, **kwargs)
        raise OSError("the database went away")

    monkeypatch.setattr(frames, "iter_batches", failing)
    with pytest.raises(OSError, match="went away"):
        b"".join(query.export(stored.engine, JOB, "steps", "ndjson"))
