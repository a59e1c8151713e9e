"""The node_levels table: write a job's node and GPU levels, read them for fleet health.

The fleet read is Arrow-native (stepscope.store.frames.fetch_table): 1.3 million node rows
(10,000 jobs × 128 nodes) come back without a Python object per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl
import pyarrow as pa
import sqlalchemy as sa

from stepscope.store import frames, tables
from stepscope.store.arrow_sql import ARROW_TYPES, Kind, keyed_select
from stepscope.store.rollup_tables import Connectable, connection

FLEET_COLUMNS: dict[str, Kind] = {
    "job_id": "str",
    "node": "str",
    "ts": "float",
    "excess": "float",
    "se": "float",
    "num_ranks": "int",
    "updated_at": "float",
}
"""What fleet health reads of each node row."""


def replace_job_levels(
    conn: sa.Connection, job_id: str, levels: pl.DataFrame, ts: float | None, now: float
) -> None:
    """Make `levels` (stepscope.analysis.fleet.node_levels.job_levels) the job's rows."""
    t = tables.node_levels
    conn.execute(sa.delete(t).where(t.c.job_id == job_id))
    if levels.is_empty():
        return
    rows = [
        {**row, "job_id": job_id, "ts": ts, "updated_at": now}
        for row in levels.select(
            "node", "gpu", "ranks", "num_ranks", "excess", "se", "num_buckets"
        ).to_dicts()
    ]
    conn.execute(sa.insert(t), rows)


def insert_rows(
    conn: sa.Connection, job_rows: Sequence[dict[str, Any]], level_rows: Sequence[dict[str, Any]]
) -> None:
    """Insert jobs rows and node_levels rows as they are (generated fleets, benchmarks)."""
    if job_rows:
        conn.execute(sa.insert(tables.jobs), list(job_rows))
    for i in range(0, len(level_rows), 100_000):
        conn.execute(sa.insert(tables.node_levels), list(level_rows[i : i + 100_000]))


def stamp(db: Connectable) -> tuple[int, float]:
    """(node rows, latest updated_at) of the table: what a cached fleet read checks."""
    t = tables.node_levels
    query = sa.select(sa.func.count(), sa.func.max(t.c.updated_at)).where(t.c.gpu == "")
    with connection(db) as conn:
        count, latest = conn.execute(query).one()
    return int(count), float(latest) if latest is not None else float("-inf")


def read_fleet_levels(engine: sa.Engine, *, updated_after: float | None = None) -> pl.DataFrame:
    """Node rows (FLEET_COLUMNS) of every job, or of those updated after a time. All rows
    come Arrow-native; the few of an update through SQLAlchemy (an Arrow read costs ~0.3 s
    however few rows it returns)."""
    if updated_after is not None:
        return _recent_rows(engine, updated_after)
    dialect = engine.dialect.name
    where = ["\"gpu\" = ''"]
    sql = keyed_select(dialect, '"node_levels"', where, FLEET_COLUMNS, ("job_id", "node"))
    schema = pa.schema([(n, ARROW_TYPES[k]) for n, k in FLEET_COLUMNS.items()])
    select = frames.Select(sql, [], schema, dialect == "sqlite", None)
    frame = pl.from_arrow(frames.fetch_table(engine, select))
    assert isinstance(frame, pl.DataFrame)
    return frame.rechunk()  # one chunk per column: a reader's many batches slow every pass


def read_node_rows(engine: sa.Engine, node: str) -> pl.DataFrame:
    """Every row of one node (its own, gpu "", and its GPUs'), oldest job first."""
    t = tables.node_levels
    columns = ("job_id", "gpu", "ranks", "num_ranks", "excess", "se", "num_buckets", "ts")
    query = sa.select(*(t.c[c] for c in columns)).where(t.c.node == node)
    with engine.connect() as conn:
        rows = conn.execute(query.order_by(t.c.ts, t.c.job_id, t.c.gpu)).all()
    schema: dict[str, Any] = {
        "job_id": pl.String,
        "gpu": pl.String,
        "ranks": pl.String,
        "num_ranks": pl.Int64,
        "excess": pl.Float64,
        "se": pl.Float64,
        "num_buckets": pl.Int64,
        "ts": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema, orient="row")


def _recent_rows(engine: sa.Engine, updated_after: float) -> pl.DataFrame:
    t = tables.node_levels
    query = sa.select(*(t.c[c] for c in FLEET_COLUMNS)).where(
        t.c.gpu == "", t.c.updated_at > updated_after
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()  # no ORDER BY: the updated_at index serves it
    kinds = {"str": pl.String, "float": pl.Float64, "int": pl.Int64}
    schema = {n: kinds[k] for n, k in FLEET_COLUMNS.items()}
    return pl.DataFrame(rows, schema=schema, orient="row")
