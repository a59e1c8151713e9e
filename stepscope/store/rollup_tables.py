"""Rollup tables (DESIGN §6): replace the rows of recomputed keys, read them back as frames.

The rank × step buckets are stored one row per bucket with a float32 vector per statistic
over the job's ranks, so a heatmap of a 1,024-rank job reads 1,024 rows; GPU buckets keep
one Arrow IPC blob of per-device statistics per time bucket.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import sqlalchemy as sa
from numpy.typing import NDArray

from stepscope.store import tables
from stepscope.store.writer import insert_ignoring_duplicates

BUCKET_STATS = tuple(f"{m}_{a}" for m in tables.ROLLUP_METRICS for a in ("sum", "count", "max"))

Connectable = sa.Engine | sa.Connection


def connection(db: Connectable) -> Any:
    """A context manager yielding a connection: a new one of an engine, or `db` itself."""
    if isinstance(db, sa.Engine):
        return db.connect()
    return _Borrowed(db)


class _Borrowed:
    def __init__(self, conn: sa.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> sa.Connection:
        return self._conn

    def __exit__(self, *_: object) -> None:
        return None


def _insert_frame(conn: sa.Connection, table: sa.Table, job_id: str, frame: pl.DataFrame) -> None:
    if frame.is_empty():
        return
    floats = [c for c, t in frame.schema.items() if t.is_float()]
    frame = frame.with_columns(pl.col(floats).fill_nan(None)) if floats else frame
    values: dict[str, list[Any]] = {"job_id": [job_id] * frame.height}
    values.update({c: frame[c].to_list() for c in frame.columns if c in table.c})
    insert_ignoring_duplicates(conn, table, values)


def replace_step_rows(
    conn: sa.Connection, table: sa.Table, job_id: str, frame: pl.DataFrame, steps: Sequence[int]
) -> None:
    """Make `frame` the rows of `table` (step_rollups, op_rollups) for these steps of a job."""
    if len(steps) == 0:
        return
    lo, hi = int(min(steps)), int(max(steps))
    where = (table.c.job_id == job_id) & table.c.step.between(lo, hi)
    if hi - lo + 1 != len(set(steps)):
        where &= table.c.step.in_(sorted({int(s) for s in steps}))
    conn.execute(sa.delete(table).where(where))
    _insert_frame(conn, table, job_id, frame)


def read_step_rows(
    conn: sa.Connection, table: sa.Table, job_id: str, columns: Sequence[str]
) -> pl.DataFrame:
    """A job's rows of step_rollups or op_rollups (these columns, in key order) as `conn` sees
    them: a pass reads back the rollups it wrote in its own, uncommitted transaction (the
    Arrow reads of stepscope.store.reads see only committed rows). Same frame as
    `reads.read_rollup`."""
    keys = [c for c in table.primary_key.columns if c.name != "job_id"]
    query = sa.select(*(table.c[n] for n in columns)).where(table.c.job_id == job_id)
    rows = conn.execute(query.order_by(*keys)).all()
    return pl.DataFrame(rows, schema={n: _polars_type(table.c[n]) for n in columns}, orient="row")


def _polars_type(column: sa.Column[Any]) -> pl.DataType:
    if isinstance(column.type, sa.Float):
        return pl.Float64()
    if isinstance(column.type, sa.Integer):
        return pl.Int64()
    return pl.String()


# --- rank × step buckets ------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class RankBuckets:
    """A job's rank × step buckets as dense (buckets × ranks) matrices, NaN where absent."""

    bucket_steps: int
    first_steps: NDArray[np.int64]
    ranks: NDArray[np.int64]
    stats: dict[str, NDArray[np.float32]]

    def frame(self) -> pl.DataFrame:
        """Long form: first_step, rank and each statistic (rows with no steps left out)."""
        b, r = np.meshgrid(self.first_steps, self.ranks, indexing="ij")
        frame = pl.DataFrame(
            {
                "first_step": b.ravel(),
                "rank": r.ravel(),
                **{name: m.ravel() for name, m in self.stats.items()},
            }
        )
        counts = [c for c in self.stats if c.endswith("_count")]
        frame = frame.with_columns(pl.col(counts).fill_nan(0).cast(pl.Int64))
        present = pl.any_horizontal(pl.col(c) > 0 for c in counts) if counts else pl.lit(True)
        return frame.filter(present)


def write_rank_buckets(
    conn: sa.Connection, job_id: str, bucket_steps: int, buckets: pl.DataFrame
) -> None:
    """Replace the job's buckets of these first_steps (long form, rollups.rank_buckets)."""
    if buckets.is_empty():
        return
    t = tables.rank_buckets
    firsts = buckets["first_step"].unique().sort().to_list()
    conn.execute(sa.delete(t).where((t.c.job_id == job_id) & t.c.first_step.in_(firsts)))
    rows = []
    for (first,), part in buckets.sort("first_step", "rank").group_by(
        "first_step", maintain_order=True
    ):
        row: dict[str, Any] = {
            "job_id": job_id,
            "first_step": int(first),
            "bucket_steps": bucket_steps,
            "ranks": part["rank"].to_numpy().astype("<i4").tobytes(),
        }
        for name in BUCKET_STATS:
            row[name] = part[name].to_numpy().astype("<f4").tobytes()
        rows.append(row)
    conn.execute(sa.insert(t), rows)


def read_rank_buckets(
    db: Connectable,
    job_id: str,
    *,
    stats: Sequence[str] = BUCKET_STATS,
    from_step: int | None = None,
    to_step: int | None = None,
) -> RankBuckets | None:
    """The job's rank × step buckets (those overlapping a step range); None if it has none."""
    t = tables.rank_buckets
    query = sa.select(t.c.first_step, t.c.bucket_steps, t.c.ranks, *(t.c[s] for s in stats))
    query = query.where(t.c.job_id == job_id).order_by(t.c.first_step)
    if to_step is not None:
        query = query.where(t.c.first_step <= to_step)
    if from_step is not None:
        query = query.where(t.c.first_step + t.c.bucket_steps > from_step)
    with connection(db) as conn:
        rows = conn.execute(query).all()
    if not rows:
        return None
    rank_vectors = [np.frombuffer(r.ranks, dtype="<i4") for r in rows]
    ranks = np.unique(np.concatenate(rank_vectors)).astype(np.int64)
    out = {s: np.full((len(rows), ranks.size), np.nan, dtype=np.float32) for s in stats}
    for i, (row, row_ranks) in enumerate(zip(rows, rank_vectors, strict=True)):
        columns = np.searchsorted(ranks, row_ranks)
        for s in stats:
            out[s][i, columns] = np.frombuffer(row._mapping[s], dtype="<f4")
    return RankBuckets(
        bucket_steps=int(rows[-1].bucket_steps),
        first_steps=np.array([r.first_step for r in rows], dtype=np.int64),
        ranks=ranks,
        stats=out,
    )


# --- GPU buckets ----------------------------------------------------------------------------


def write_gpu_buckets(
    conn: sa.Connection, job_id: str, bucket_s: float, buckets: pl.DataFrame, spread: pl.DataFrame
) -> None:
    """Replace the job's GPU buckets of these first_ts: per-device statistics (long form,
    rollups.gpu_buckets) and their spread over devices (rollups.gpu_spread)."""
    if buckets.is_empty():
        return
    t = tables.gpu_buckets
    firsts = buckets["first_ts"].unique().sort().to_list()
    conn.execute(sa.delete(t).where((t.c.job_id == job_id) & t.c.first_ts.in_(firsts)))
    spread_rows = {r["first_ts"]: r for r in spread.fill_nan(None).to_dicts()}
    rows = []
    for (first,), part in buckets.sort("first_ts").group_by("first_ts", maintain_order=True):
        blob = io.BytesIO()
        part.drop("first_ts").write_ipc(blob, compression="uncompressed")
        rows.append(
            {
                **spread_rows[first],
                "job_id": job_id,
                "first_ts": first,
                "bucket_s": bucket_s,
                "arrays": blob.getvalue(),
            }
        )
    conn.execute(sa.insert(t), rows)


def read_gpu_buckets(
    db: Connectable,
    job_id: str,
    *,
    from_ts: float | None = None,
    to_ts: float | None = None,
) -> tuple[float, pl.DataFrame] | None:
    """(bucket width, long-form GPU buckets) of a job in a time range; None if it has none."""
    t = tables.gpu_buckets
    query = sa.select(t.c.first_ts, t.c.bucket_s, t.c.arrays).where(t.c.job_id == job_id)
    if from_ts is not None:
        query = query.where(t.c.first_ts + t.c.bucket_s > from_ts)
    if to_ts is not None:
        query = query.where(t.c.first_ts <= to_ts)
    with connection(db) as conn:
        rows = conn.execute(query.order_by(t.c.first_ts)).all()
    if not rows:
        return None
    parts = [
        pl.read_ipc(io.BytesIO(r.arrays)).with_columns(pl.lit(r.first_ts).alias("first_ts"))
        for r in rows
    ]
    frame = pl.concat(parts, how="diagonal_relaxed")
    return float(rows[-1].bucket_s), frame.select("first_ts", pl.exclude("first_ts"))


def delete_rank_buckets(conn: sa.Connection, job_id: str) -> None:
    """Remove a job's rank × step buckets (before they are written at a new width)."""
    t = tables.rank_buckets
    conn.execute(sa.delete(t).where(t.c.job_id == job_id))


def delete_gpu_buckets(conn: sa.Connection, job_id: str) -> None:
    """Remove a job's GPU buckets (before they are written at a new width)."""
    t = tables.gpu_buckets
    conn.execute(sa.delete(t).where(t.c.job_id == job_id))


def delete_job_rollups(conn: sa.Connection, job_id: str) -> None:
    """Remove every rollup and the analysis state of a job."""
    for table in tables.ROLLUP_TABLES:
        conn.execute(sa.delete(table).where(table.c.job_id == job_id))
