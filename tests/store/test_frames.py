"""Arrow-native reads of stored job tables (frames.read_frame, iter_batches), on both engines."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pytest
import sqlalchemy as sa
from polars.testing import assert_frame_equal

from stepscope.store import frames, tables
from stepscope.store.engine import make_engine
from stepscope.store.frames import arrow_schema, iter_batches, read_frame
from stepscope.store.migrate import upgrade
from stepscope.store.writer import BatchWriter
from tests.support import fresh_postgres_database

JOB = "job-a"
STEPS_DTYPES = {
    "job_id": pl.String,
    "rank": pl.Int64,
    "step": pl.Int64,
    "ts": pl.Float64,
    "step_s": pl.Float64,
    "data_s": pl.Float64,
    "h2d_s": pl.Float64,
    "forward_s": pl.Float64,
    "backward_s": pl.Float64,
    "optimizer_s": pl.Float64,
    "comm_s": pl.Float64,
    "comm_wait_s": pl.Float64,
    "compute_s": pl.Float64,
    "tokens": pl.Int64,
    "samples": pl.Int64,
    "flops": pl.Float64,
    "mem_peak_bytes": pl.Int64,
    "step_rule": pl.String,
}
_seq = itertools.count()


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


def store(
    engine: sa.Engine, rank: int, job_id: str = JOB, **sections: dict[str, list[Any]]
) -> None:
    """Write one rank's batch through the real writer."""
    for name, columns in sections.items():
        num_rows = len(next(iter(columns.values())))
        sections[name] = {**columns, "job_id": [job_id] * num_rows, "rank": [rank] * num_rows}
    writer = BatchWriter(engine)
    try:
        writer.write(
            job={"job_id": job_id},
            source={"rank": rank, "incarnation": "i", "node": f"host-{rank}"},
            seq=next(_seq),
            sections=sections,
        )
    finally:
        writer.close()


def steps(rank: int, step_numbers: list[int], **extra: list[Any]) -> dict[str, list[Any]]:
    return {
        "step": step_numbers,
        "ts": [1000.0 + s + rank / 10 for s in step_numbers],
        "step_s": [0.5 + s / 100 for s in step_numbers],
        "data_s": [0.01 * rank for _ in step_numbers],
        **extra,
    }


def steps_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Expected steps frame: every stored column, unset ones null, in (rank, step) order."""
    return pl.DataFrame(
        [{name: row.get(name) for name in STEPS_DTYPES} for row in rows], schema=STEPS_DTYPES
    ).sort("rank", "step")


def rows_of(rank: int, columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [
        {"job_id": JOB, "rank": rank, **dict(zip(columns, values, strict=True))}
        for values in zip(*columns.values(), strict=True)
    ]


def test_read_frame_returns_the_written_rows_in_key_order_with_canonical_dtypes(
    engine: sa.Engine,
) -> None:
    rank1 = steps(
        1, [2, 0, 1], h2d_s=[None, 0.002, 0.003], tokens=[10, 11, 12], step_rule=["optimizer"] * 3
    )
    rank0 = steps(0, [1, 0, 2], flops=[1e12, 2e12, None], mem_peak_bytes=[2**40, 5, 6])
    store(engine, 1, steps=rank1)
    store(engine, 0, steps=rank0)
    store(engine, 0, job_id="job-b", steps=steps(0, [0]))

    frame = read_frame(engine, "steps", JOB)

    assert frame.schema == pl.Schema(STEPS_DTYPES)
    assert_frame_equal(frame, steps_frame(rows_of(1, rank1) + rows_of(0, rank0)))
    assert frame.select("rank", "step").rows() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_step_range_is_inclusive_and_ranks_and_columns_select_rows_and_columns(
    engine: sa.Engine,
) -> None:
    for rank in range(4):
        store(engine, rank, steps=steps(rank, list(range(10))))

    frame = read_frame(
        engine,
        "steps",
        JOB,
        columns=["step_s", "rank", "step"],
        from_step=3,
        to_step=5,
        ranks=[3, 1],
    )

    assert frame.columns == ["step_s", "rank", "step"]
    assert frame.rows() == [(0.5 + s / 100, r, s) for r in (1, 3) for s in (3, 4, 5)]
    assert read_frame(engine, "steps", JOB, ranks=[]).height == 0
    only_late = read_frame(engine, "steps", JOB, columns=["step"], from_step=8, ranks=[0])
    assert only_late["step"].to_list() == [8, 9]


def test_optional_columns_null_in_the_first_rows_keep_their_dtype_and_later_values(
    engine: sa.Engine,
) -> None:
    # More leading NULLs than the first batch of ADBC's SQLite reader (its types come from it).
    num_steps, num_null = 70_000, 66_000
    late = [None] * num_null + [0.25] * (num_steps - num_null)
    late_int = [None] * num_null + [7] * (num_steps - num_null)
    store(engine, 0, steps=steps(0, list(range(num_steps)), h2d_s=late, tokens=late_int))
    messages = [None] * num_null + ["late"] * (num_steps - num_null)
    events = {
        "ts": [float(i) for i in range(num_steps)],
        "kind": ["custom"] * num_steps,
        "message": messages,
        "attributes": [None] * num_null + ['{"n":1}'] * (num_steps - num_null),
    }
    store(engine, 0, events=events)
    dtypes = {"step": pl.Int64, "h2d_s": pl.Float64, "tokens": pl.Int64, "forward_s": pl.Float64}

    frame = read_frame(engine, "steps", JOB, columns=list(dtypes))
    batches = iter_batches(engine, "steps", JOB, columns=list(dtypes), batch_rows=1000)
    streamed = pl.DataFrame(pa.Table.from_batches(list(batches)))

    for got in (frame, streamed):
        assert got.schema == pl.Schema(dtypes)
        assert got["h2d_s"].to_list() == late
        assert got["tokens"].to_list() == late_int
        assert got["forward_s"].null_count() == num_steps
    events_frame = read_frame(engine, "events", JOB, columns=["message", "attributes"])
    assert events_frame.schema == pl.Schema({"message": pl.String, "attributes": pl.String})
    assert events_frame["message"].to_list() == messages
    assert events_frame["attributes"].to_list() == events["attributes"]


@pytest.mark.parametrize("table", ["steps", "collectives", "gpu", "events", "ranks"])
def test_an_empty_result_has_the_canonical_schema(engine: sa.Engine, table: str) -> None:
    store(engine, 0, steps=steps(0, [0, 1]))

    frame = read_frame(engine, table, "no-such-job")

    assert frame.height == 0
    assert frame.schema == pl.DataFrame(arrow_schema(table).empty_table()).schema
    assert set(frame.schema.dtypes()) <= {pl.String, pl.Int64, pl.Float64}


def test_event_attributes_come_back_as_json_text_and_ts_range_is_half_open(
    engine: sa.Engine,
) -> None:
    attributes = [{"xid": 79, "gpu": "0000:3b:00.0"}, {}, {"nested": {"a": [1, 2.5]}}]
    events = {
        "ts": [10.0, 11.0, 12.0],
        "kind": ["xid", "custom", "oom"],
        "message": ["fell off the bus", None, "out of memory"],
        "attributes": [json.dumps(a) for a in attributes],
    }
    store(engine, 2, events=events)

    frame = read_frame(engine, "events", JOB)
    assert frame["attributes"].dtype == pl.String
    assert [json.loads(a) for a in frame["attributes"]] == attributes
    assert frame["message"].to_list() == events["message"]

    window = read_frame(engine, "events", JOB, columns=["ts", "kind"], from_ts=10.0, to_ts=12.0)
    assert window.rows() == [(10.0, "xid"), (11.0, "custom")]


def test_gpu_samples_come_ordered_by_rank_gpu_index_and_ts(engine: sa.Engine) -> None:
    gpu = {"ts": [2.0, 1.0, 2.0, 1.0], "gpu_index": [1, 1, 0, 0], "util": [40.0, 30.0, 20.0, 10.0]}
    store(engine, 0, gpu=gpu)

    frame = read_frame(engine, "gpu", JOB, columns=["gpu_index", "ts", "util"], from_ts=1.0)

    assert frame.rows() == [(0, 1.0, 10.0), (0, 2.0, 20.0), (1, 1.0, 30.0), (1, 2.0, 40.0)]


def test_unknown_table_column_or_filter_raises_value_error_naming_it(engine: sa.Engine) -> None:
    with pytest.raises(ValueError, match="'bogus_s'"):
        read_frame(engine, "steps", JOB, columns=["step", "bogus_s"])
    with pytest.raises(ValueError, match="'node'"):  # a step's node lives in `ranks`
        read_frame(engine, "steps", JOB, columns=["node"])
    with pytest.raises(ValueError, match="'gpu_samples'"):
        read_frame(engine, "gpu_samples", JOB)
    with pytest.raises(ValueError, match="gpu has no step column"):
        read_frame(engine, "gpu", JOB, from_step=3)
    with pytest.raises(ValueError, match="repeated"):
        read_frame(engine, "steps", JOB, columns=["step", "step"])
    with pytest.raises(ValueError, match="'bogus_s'"):  # at the call, before any batch
        iter_batches(engine, "steps", JOB, columns=["bogus_s"])


def test_iter_batches_streams_the_rows_of_read_frame_in_bounded_batches(
    engine: sa.Engine,
) -> None:
    for rank in (2, 0, 1):
        store(engine, rank, steps=steps(rank, list(range(40)), h2d_s=[None] * 39 + [0.1]))

    filters: list[dict[str, Any]] = [
        {},
        {"columns": ["h2d_s", "step"], "from_step": 5, "ranks": [2]},
    ]
    for kwargs in filters:
        batches = list(iter_batches(engine, "steps", JOB, batch_rows=7, **kwargs))
        assert all(0 < b.num_rows <= 7 for b in batches)
        assert all(b.schema == batches[0].schema for b in batches)
        streamed = pl.DataFrame(pa.Table.from_batches(batches))
        assert_frame_equal(streamed, read_frame(engine, "steps", JOB, **kwargs))
    assert list(iter_batches(engine, "steps", "no-such-job")) == []


def test_a_streamed_read_of_many_reads_keeps_the_order_and_rows_of_one_read(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ranks with gaps between them, 30 rows each: two ranks a read
    for rank in (7, 0, 5, 2, 9):
        store(engine, rank, steps=steps(rank, list(range(30))))
    monkeypatch.setattr(frames, "ROWS_PER_READ", 60)
    assert frames._rows_per_rank(engine, "steps", JOB) == 30

    for kwargs in ({}, {"ranks": [9, 2, 5, 7]}, {"from_step": 28, "columns": ["rank", "step"]}):
        batches = list(iter_batches(engine, "steps", JOB, batch_rows=25, **kwargs))
        assert all(0 < b.num_rows <= 25 for b in batches)
        streamed = pl.DataFrame(pa.Table.from_batches(batches))
        assert_frame_equal(streamed, read_frame(engine, "steps", JOB, **kwargs))
    ranks = pl.DataFrame(pa.Table.from_batches(list(iter_batches(engine, "steps", JOB))))["rank"]
    assert ranks.unique(maintain_order=True).to_list() == [0, 2, 5, 7, 9]
    assert ranks.len() == 150


def filled_columns(engine: sa.Engine, job_id: str = JOB) -> set[tuple[str, str]]:
    jc = tables.job_columns
    query = sa.select(jc.c.table_name, jc.c.column_name).where(jc.c.job_id == job_id)
    with engine.connect() as conn:
        return {(t, c) for t, c in conn.execute(query)}


def test_columns_a_job_never_filled_are_recorded_and_read_back_as_nulls(engine: sa.Engine) -> None:
    rank0 = steps(0, [0, 1], forward_s=[None, None], tokens=[5, None])
    store(engine, 0, steps=rank0, events={"ts": [1.0], "kind": ["custom"], "message": ["m"]})
    store(engine, 1, job_id="job-b", steps=steps(1, [0], flops=[1e12]))

    assert filled_columns(engine) == {("steps", "tokens"), ("events", "message")}
    assert filled_columns(engine, "job-b") == {("steps", "flops")}
    query = frames._select(engine, "steps", JOB, None, None, None, None, None, None)
    assert query.unread == ()
    skipping = frames._select(
        engine,
        "steps",
        JOB,
        None,
        None,
        None,
        None,
        None,
        None,
        frames._unfilled_columns(engine, "steps", JOB),
    )
    assert "forward_s" in skipping.unread
    assert "tokens" not in skipping.unread
    assert '"forward_s"' not in skipping.sql
    expected = steps_frame(rows_of(0, rank0))
    assert_frame_equal(read_frame(engine, "steps", JOB), expected)
    streamed = pa.Table.from_batches(list(iter_batches(engine, "steps", JOB)))
    assert_frame_equal(pl.DataFrame(streamed), expected)
    with engine.connect() as conn:  # nothing else was written: the nulls are the stored rows
        stored = pl.read_database(sa.select(tables.steps).where(tables.steps.c.job_id == JOB), conn)
    assert_frame_equal(stored.sort("rank", "step"), expected, check_dtypes=False)


def test_a_column_first_filled_by_a_later_batch_or_during_a_read_is_read(
    engine: sa.Engine,
) -> None:
    store(engine, 0, steps=steps(0, [0, 1]))
    assert read_frame(engine, "steps", JOB)["forward_s"].null_count() == 2
    store(engine, 0, steps=steps(0, [2], forward_s=[0.125]))
    assert read_frame(engine, "steps", JOB)["forward_s"].to_list() == [None, None, 0.125]

    # A batch committed between the look-up of the unfilled columns and the read of the rows:
    # the read sees its row, and its value too.
    unfilled = frames._unfilled_columns(engine, "steps", JOB)
    assert "backward_s" in unfilled
    selects: list[frozenset[str]] = []

    def select(skipped: frozenset[str]) -> frames.Select:
        if not selects:
            store(engine, 1, steps=steps(1, [0], backward_s=[0.5]))
        selects.append(skipped)
        return frames._select(engine, "steps", JOB, None, None, None, None, None, None, skipped)

    data, after = frames._read_filled(engine, "steps", JOB, select, unfilled)
    assert pl.DataFrame(data)["backward_s"].to_list() == [None, None, None, 0.5]
    assert [("backward_s" in s) for s in selects] == [True, False]
    assert "backward_s" not in after


def test_reads_see_rows_written_after_an_earlier_read(engine: sa.Engine) -> None:
    store(engine, 0, steps=steps(0, [0]))
    assert read_frame(engine, "steps", JOB).height == 1
    store(engine, 0, steps=steps(0, [1]))
    assert read_frame(engine, "steps", JOB)["step"].to_list() == [0, 1]


def test_concurrent_reads_from_many_threads_return_the_same_frame(engine: sa.Engine) -> None:
    for rank in range(8):
        store(engine, rank, steps=steps(rank, list(range(50))))
    expected = read_frame(engine, "steps", JOB)

    with ThreadPoolExecutor(max_workers=12) as pool:
        frames = list(pool.map(lambda _: read_frame(engine, "steps", JOB), range(48)))

    for frame in frames:
        assert_frame_equal(frame, expected)


def test_an_in_memory_sqlite_database_is_read_through_sqlalchemy() -> None:
    engine = sa.create_engine(
        "sqlite://", poolclass=sa.StaticPool, connect_args={"check_same_thread": False}
    )
    upgrade(engine)
    rank3 = steps(3, [1, 0], h2d_s=[None, 0.5])
    store(engine, 3, steps=rank3)

    frame = read_frame(engine, "steps", JOB)

    assert_frame_equal(frame, steps_frame(rows_of(3, rank3)))
    batches = list(iter_batches(engine, "steps", JOB, columns=["step"], batch_rows=1))
    assert [b.to_pydict() for b in batches] == [{"step": [0]}, {"step": [1]}]
    assert read_frame(engine, "events", JOB).schema["attributes"] == pl.String


def test_ts_bounds_compare_exact_float_values(engine: sa.Engine) -> None:
    ts = [0.1 + 0.2, 0.3, 1.7e9 + 0.123456789]
    events = {"ts": ts, "kind": ["custom"] * 3, "message": [None] * 3, "attributes": ["{}"] * 3}
    store(engine, 0, events=events)

    def window(**bounds: float) -> list[float]:
        return read_frame(engine, "events", JOB, columns=["ts"], **bounds)["ts"].to_list()

    assert window(from_ts=0.1 + 0.2) == [0.1 + 0.2, 1.7e9 + 0.123456789]
    assert window(to_ts=0.1 + 0.2) == [0.3]
    assert window(from_ts=1.7e9 + 0.123456789, to_ts=2e9) == [1.7e9 + 0.123456789]


def test_a_stream_left_half_read_does_not_disturb_later_reads(engine: sa.Engine) -> None:
    store(engine, 0, steps=steps(0, list(range(3000))))

    batches = iter_batches(engine, "steps", JOB, batch_rows=100)
    assert 0 < next(batches).num_rows <= 100
    batches.close()

    assert read_frame(engine, "steps", JOB, columns=["step"])["step"].to_list() == list(range(3000))


def test_pooled_postgresql_connections_idle_outside_a_transaction_and_are_replaced() -> None:
    with fresh_postgres_database() as url:
        engine = make_engine(url)
        try:
            upgrade(engine)
            store(engine, 0, steps=steps(0, [0, 1]))
            assert read_frame(engine, "steps", JOB).height == 2
            assert sum(b.num_rows for b in iter_batches(engine, "steps", JOB, batch_rows=1)) == 2
            with engine.connect() as conn:
                states = conn.execute(
                    sa.text(
                        "SELECT state FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
                assert "idle in transaction" not in set(states.scalars())
                conn.execute(  # as a server restart would
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
            assert read_frame(engine, "steps", JOB).height == 2
        finally:
            engine.dispose()


def test_sqlite_reads_keep_a_second_sqlite_library_out_of_this_process(tmp_path: Path) -> None:
    """ADBC's driver links its own SQLite; beside sqlite3 in one process it breaks WAL locking."""
    url = f"sqlite:///{tmp_path / 'one-library.db'}"
    code = f"""
import sys
from stepscope.store import frames
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
engine = make_engine({url!r})
upgrade(engine)
frames.read_frame(engine, "steps", "j")
list(frames.iter_batches(engine, "steps", "j"))
print("adbc_driver_sqlite" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
