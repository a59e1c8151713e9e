"""Reads for the query layer (stepscope.query): Arrow-native rollup reads, the jobs list,
slowest-rank counts and findings with their row ids.

Rollups come through the ADBC connections of `stepscope.store.frames`, without a Python
object per row: all columns of 10,000 step rollups read in ~27 ms (SQLite) / ~49 ms
(PostgreSQL) against 83 / 124 ms through SQLAlchemy rows (`rollup_tables.read_step_rows`);
the float32 vectors of 625 rank buckets × 1,024 ranks in 18 ms against 38 / 62 ms.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc
import sqlalchemy as sa

from stepscope import schema
from stepscope.store import frames, tables
from stepscope.store.rollup_tables import RankBuckets

_SQL_TYPES = {
    "sqlite": {"float": "REAL", "int": "INTEGER", "str": "TEXT", "bytes": "BLOB"},
    "postgresql": {"float": "double precision", "int": "bigint", "str": "text", "bytes": "bytea"},
}
_TYPED_VALUES = {"float": "0.0", "int": "0", "str": "''", "bytes": "X''"}
_ARROW_TYPES = {"float": pa.float64(), "int": pa.int64(), "str": pa.string(), "bytes": pa.binary()}


def _kind(column: sa.Column[Any]) -> str:
    if isinstance(column.type, sa.Float):
        return "float"
    if isinstance(column.type, sa.Integer):
        return "int"
    if isinstance(column.type, sa.LargeBinary):
        return "bytes"
    return "str"


def _arrow_select(
    engine: sa.Engine,
    table: sa.Table,
    job_id: str,
    columns: Sequence[str],
    where: Sequence[tuple[str, str, Any]] = (),
    one_of: tuple[str, Sequence[str]] | None = None,
) -> frames.Select:
    """A read of `columns` of a job's rows of a keyed table, in key order, for ADBC; with
    `one_of` (column, values), only rows whose column holds one of the values."""
    dialect = engine.dialect.name
    unknown = [c for c in columns if c not in table.c]
    if unknown:
        raise ValueError(f"{table.name} has no column {', '.join(map(repr, unknown))}")
    params: list[Any] = []

    def bind(value: Any) -> str:
        params.append(value)
        return "?" if dialect == "sqlite" else f"${len(params)}"

    conditions = [f'"job_id" = {bind(job_id)}']
    conditions += [f"{expr} {op} {bind(value)}" for expr, op, value in where]
    if one_of is not None:
        column, values = one_of
        conditions.append(f'"{column}" IN ({", ".join(bind(v) for v in values)})')
    keys = [c.name for c in table.primary_key.columns if c.name != "job_id"]
    names = [*columns, *(k for k in keys if k not in columns)]
    kinds = {n: _kind(table.c[n]) for n in names}
    sql_type = {n: _SQL_TYPES[dialect][kinds[n]] for n in names}
    # As in frames: keys (never NULL) as stored so the key index gives the order; the rest
    # CAST, and on SQLite a first row of typed values fixes the types ADBC infers.
    select = ", ".join(f'"{n}"' if n in keys else f'CAST("{n}" AS {sql_type[n]})' for n in names)
    sql = f'SELECT {select} FROM "{table.name}" WHERE {" AND ".join(conditions)}'
    typing_row = dialect == "sqlite"
    if typing_row:
        typed = ", ".join(
            f"{'NULL' if n in keys else f'CAST({_TYPED_VALUES[kinds[n]]} AS {sql_type[n]})'} "
            f'AS "{n}"'
            for n in names
        )
        sql = f"SELECT {typed} UNION ALL {sql}"
    sql += " ORDER BY " + ", ".join(str(names.index(k) + 1) for k in keys)
    target = pa.schema([(n, _ARROW_TYPES[kinds[n]]) for n in columns])
    return frames.Select(sql=sql, params=params, schema=target, typing_row=typing_row, setup=None)


_fetch = frames.fetch_table


def _step_range(from_step: int | None, to_step: int | None) -> list[tuple[str, str, Any]]:
    where: list[tuple[str, str, Any]] = []
    if from_step is not None:
        where.append(('"step"', ">=", int(from_step)))
    if to_step is not None:
        where.append(('"step"', "<=", int(to_step)))
    return where


def read_rollup(
    engine: sa.Engine,
    table: sa.Table,
    job_id: str,
    *,
    columns: Sequence[str],
    from_step: int | None = None,
    to_step: int | None = None,
) -> pl.DataFrame:
    """A job's rows of step_rollups or op_rollups (these columns, in key order), Arrow-native."""
    query = _arrow_select(engine, table, job_id, columns, _step_range(from_step, to_step))
    return pl.DataFrame(_fetch(engine, query))


def read_bucket_matrices(
    engine: sa.Engine,
    job_id: str,
    *,
    stats: Sequence[str],
    from_step: int | None = None,
    to_step: int | None = None,
) -> RankBuckets | None:
    """`rollup_tables.read_rank_buckets`, Arrow-native: the buckets overlapping a step range."""
    where: list[tuple[str, str, Any]] = []
    if to_step is not None:
        where.append(('"first_step"', "<=", int(to_step)))
    if from_step is not None:
        where.append(('"first_step" + "bucket_steps"', ">", int(from_step)))
    columns = ["first_step", "bucket_steps", "ranks", *stats]
    data = _fetch(engine, _arrow_select(engine, tables.rank_buckets, job_id, columns, where))
    if data.num_rows == 0:
        return None
    rank_blobs = data.column("ranks").to_pylist()
    first_steps = data.column("first_step").to_numpy().astype(np.int64)
    bucket_steps = int(data.column("bucket_steps")[-1].as_py())
    if all(b == rank_blobs[0] for b in rank_blobs):  # the usual case: one matrix per blob column
        ranks = np.frombuffer(rank_blobs[0], dtype="<i4").astype(np.int64)
        out = {s: _blob_matrix(data.column(s), ranks.size) for s in stats}
        if np.any(ranks[1:] < ranks[:-1]):
            order = np.argsort(ranks)
            ranks, out = ranks[order], {s: m[:, order] for s, m in out.items()}
        return RankBuckets(
            bucket_steps=bucket_steps, first_steps=first_steps, ranks=ranks, stats=out
        )
    vectors = [np.frombuffer(b, dtype="<i4") for b in rank_blobs]
    ranks = np.unique(np.concatenate(vectors)).astype(np.int64)
    out = {s: np.full((data.num_rows, ranks.size), np.nan, dtype=np.float32) for s in stats}
    for s in stats:
        blobs = data.column(s).to_pylist()
        for i, row_ranks in enumerate(vectors):
            out[s][i, np.searchsorted(ranks, row_ranks)] = np.frombuffer(blobs[i], dtype="<f4")
    return RankBuckets(bucket_steps=bucket_steps, first_steps=first_steps, ranks=ranks, stats=out)


def _blob_matrix(column: pa.ChunkedArray, width: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Equal-length float32 blobs as a (rows × width) matrix, read from the Arrow buffers."""
    array = column.combine_chunks()
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32)[array.offset :]
    start, stop = int(offsets[0]), int(offsets[len(array)])
    values = np.frombuffer(array.buffers()[2], dtype="<f4", count=(stop - start) // 4, offset=start)
    return values.reshape(len(array), width)


def read_gpu_bucket_table(
    engine: sa.Engine,
    job_id: str,
    *,
    columns: Sequence[str] | None = None,
    from_ts: float | None = None,
    to_ts: float | None = None,
) -> tuple[float, pl.DataFrame] | None:
    """`rollup_tables.read_gpu_buckets`, Arrow-native: (bucket width, long-form buckets) or None;
    `columns` selects the per-device statistics kept (default all)."""
    where: list[tuple[str, str, Any]] = []
    if from_ts is not None:
        where.append(('"first_ts" + "bucket_s"', ">", float(from_ts)))
    if to_ts is not None:
        where.append(('"first_ts"', "<=", float(to_ts)))
    stored = ["first_ts", "bucket_s", "arrays"]
    data = _fetch(engine, _arrow_select(engine, tables.gpu_buckets, job_id, stored, where))
    if data.num_rows == 0:
        return None
    parts = [pyarrow.ipc.open_file(blob.as_buffer()).read_all() for blob in data.column("arrays")]
    lengths = np.array([p.num_rows for p in parts])
    first_ts = np.repeat(data.column("first_ts").to_numpy(), lengths)
    table = pa.concat_tables(parts, promote_options="permissive")
    if columns is not None:
        table = table.select([c for c in columns if c in table.column_names])
    long = pl.from_arrow(table)
    assert isinstance(long, pl.DataFrame)
    long = long.with_columns(pl.Series("first_ts", first_ts, dtype=pl.Float64))
    width = float(data.column("bucket_s")[-1].as_py())
    return width, long.select("first_ts", pl.exclude("first_ts"))


def read_gpu_spread(engine: sa.Engine, job_id: str) -> tuple[float, pl.DataFrame] | None:
    """(bucket width, per bucket: first_ts, num_devices, the spread over devices of each
    metric and the OR of throttle reasons) of a job's GPU buckets; None if it has none."""
    t = tables.gpu_buckets
    names = ["first_ts", "bucket_s", "num_devices", "throttle_reasons"]
    names += [f"{m}_{q}" for m in tables.GPU_SPREAD for q in ("min", "p50", "max")]
    data = pl.DataFrame(_fetch(engine, _arrow_select(engine, t, job_id, names)))
    if data.is_empty():
        return None
    return float(data["bucket_s"][-1]), data.drop("bucket_s")


def gpu_bucket_width(engine: sa.Engine, job_id: str) -> float | None:
    """The width of a job's GPU buckets in seconds; None if it has none."""
    t = tables.gpu_buckets
    query = sa.select(sa.func.max(t.c.bucket_s)).where(t.c.job_id == job_id)
    with engine.connect() as conn:
        width = conn.execute(query).scalar_one_or_none()
    return None if width is None else float(width)


def slowest_rank_counts(engine: sa.Engine, job_id: str) -> tuple[dict[int, int], int]:
    """(rank → steps it was the slowest rank of, steps rolled up) of a job."""
    t = tables.step_rollups
    query = (
        sa.select(t.c.slowest_rank, sa.func.count())
        .where(t.c.job_id == job_id)
        .group_by(t.c.slowest_rank)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    counts = {int(rank): int(n) for rank, n in rows if rank is not None}
    return counts, sum(int(n) for _, n in rows)


def read_findings(engine: sa.Engine, job_id: str) -> list[dict[str, Any]]:
    """The job's findings as rows (`id` and the columns of schema.FINDINGS), in id order."""
    t = tables.findings
    with engine.connect() as conn:
        rows = conn.execute(sa.select(t).where(t.c.job_id == job_id).order_by(t.c.id)).mappings()
        return [dict(row) for row in rows]


def read_findings_of_jobs(
    engine: sa.Engine, job_ids: Sequence[str], kinds: Sequence[str]
) -> list[dict[str, Any]]:
    """The findings of these kinds of these jobs, as rows (as `read_findings`), in id order."""
    t = tables.findings
    out: list[dict[str, Any]] = []
    with engine.connect() as conn:
        for start in range(0, len(job_ids), 500):
            query = sa.select(t).where(
                t.c.job_id.in_(job_ids[start : start + 500]), t.c.kind.in_(kinds)
            )
            out += [dict(row) for row in conn.execute(query.order_by(t.c.id)).mappings()]
    return sorted(out, key=lambda f: f["id"])


def read_recent_hang_findings(engine: sa.Engine, limit: int) -> list[dict[str, Any]]:
    """The `limit` newest hang findings of every job, as rows (`id` and schema.FINDINGS's
    columns), newest first (open or closed: evidence.closed_at says)."""
    t = tables.findings
    query = sa.select(t).where(t.c.kind == "hang").order_by(t.c.id.desc()).limit(limit)
    with engine.connect() as conn:
        return [dict(row) for row in conn.execute(query).mappings()]


def rank_seen(engine: sa.Engine, job_id: str, rank: int) -> bool:
    """Whether `rank` of the job has sent a batch."""
    r = tables.ranks
    query = sa.select(r.c.rank).where(r.c.job_id == job_id, r.c.rank == rank)
    with engine.connect() as conn:
        return conn.execute(query).first() is not None


def read_nodes(engine: sa.Engine, job_id: str) -> dict[int, str | None]:
    """rank → node of the ranks a job has seen."""
    ranks = frames.read_frame(engine, "ranks", job_id, columns=["rank", "node"])
    return dict(zip(ranks["rank"].to_list(), ranks["node"].to_list(), strict=True))


def read_meshes(engine: sa.Engine, job_id: str) -> dict[int, dict[str, Any] | None]:
    """rank → DeviceMesh coordinates ({dim: [coordinate, size]}, None if not sent) of the
    ranks a job has seen."""
    r = tables.ranks
    query = sa.select(r.c.rank, r.c.mesh).where(r.c.job_id == job_id).order_by(r.c.rank)
    with engine.connect() as conn:
        return {int(rank): mesh for rank, mesh in conn.execute(query).all()}


# --- the jobs list --------------------------------------------------------------------------

JOB_SORT_KEYS = (
    "started_at",
    "name",
    "world_size",
    "num_nodes",
    "last_seen",
    "step_p50_s",
    "tokens_per_s",
    "mfu",
)
JOB_STATUSES = ("running", "stale", "finished", "failed")
"""A job's status: the stored one once it ended, else running or stale by its last batch."""
_ENDED = ("finished", "failed")


@dataclass(kw_only=True, slots=True)
class JobQuery:
    """What `read_jobs` selects: filters, order and the keyset position to continue from."""

    job_id: str | None = None
    statuses: Sequence[str] = ()
    benchmark_key: str | None = None
    name_contains: str | None = None
    started_after: float | None = None
    started_before: float | None = None
    min_severity: str | None = None
    sort: str = "started_at"
    descending: bool = True
    after: tuple[Any, str] | None = None
    """(sort value, job_id) of the last row of the previous page; NULL values sort last."""
    limit: int | None = None
    stale_before: float = -np.inf
    """A running job whose last batch arrived before this time is stale."""


def read_jobs(engine: sa.Engine, q: JobQuery) -> list[dict[str, Any]]:
    """Jobs rows with their ranks' aggregates, status and summary (nulls before analysis)."""
    j, s, r = tables.jobs, tables.job_summaries, tables.ranks
    agg = (
        sa.select(
            r.c.job_id,
            sa.func.count().label("num_ranks_seen"),
            sa.func.count(sa.distinct(r.c.node)).label("num_nodes"),
            sa.func.max(r.c.last_seen).label("last_seen"),
        )
        .group_by(r.c.job_id)
        .subquery("rank_stats")
    )
    last_seen = sa.func.coalesce(agg.c.last_seen, j.c.started_at)
    status = sa.case(
        (j.c.status.in_(_ENDED), j.c.status),
        (last_seen < q.stale_before, sa.literal("stale")),
        else_=sa.literal("running"),
    ).label("status")
    summary = [c for c in s.c if c.name != "job_id"]
    query = sa.select(
        *(c for c in j.c if c.name != "status"),
        status,
        agg.c.num_ranks_seen,
        agg.c.num_nodes,
        agg.c.last_seen,
        *summary,
    ).select_from(
        j.outerjoin(s, s.c.job_id == j.c.job_id).outerjoin(agg, agg.c.job_id == j.c.job_id)
    )
    if q.job_id is not None:
        query = query.where(j.c.job_id == q.job_id)
    if q.statuses:
        query = query.where(status.in_(list(q.statuses)))
    if q.benchmark_key is not None:
        query = query.where(j.c.benchmark_key == q.benchmark_key)
    if q.name_contains:
        escaped = q.name_contains.lower().replace("\\", "\\\\").replace("%", "\\%")
        pattern = "%" + escaped.replace("_", "\\_") + "%"
        query = query.where(sa.func.lower(j.c.name).like(pattern, escape="\\"))
    if q.started_after is not None:
        query = query.where(j.c.started_at >= q.started_after)
    if q.started_before is not None:
        query = query.where(j.c.started_at < q.started_before)
    if q.min_severity is not None:
        levels = schema.SEVERITIES[schema.SEVERITIES.index(q.min_severity) :]
        query = query.where(sa.or_(*(s.c[f"num_{level}"] > 0 for level in levels)))

    key = agg.c[q.sort] if q.sort in agg.c else s.c[q.sort] if q.sort in s.c else j.c[q.sort]
    if q.after is not None:
        value, job_id = q.after
        if value is None:
            query = query.where(key.is_(None), j.c.job_id > job_id)
        else:
            beyond = key < value if q.descending else key > value
            query = query.where(key.is_(None) | beyond | ((key == value) & (j.c.job_id > job_id)))
    query = query.order_by(
        sa.case((key.is_(None), 1), else_=0), key.desc() if q.descending else key.asc(), j.c.job_id
    )
    if q.limit is not None:
        query = query.limit(q.limit)
    with engine.connect() as conn:
        return [dict(row) for row in conn.execute(query).mappings()]


def analysis_version(engine: sa.Engine, job_id: str) -> float | None:
    """When the job's rollups and findings last changed (its last analyzer pass); None if
    it has no analysis state."""
    t = tables.analysis_state
    with engine.connect() as conn:
        value = conn.execute(sa.select(t.c.updated_at).where(t.c.job_id == job_id)).scalar()
    return None if value is None else float(value)


def read_drop_reports(engine: sa.Engine, job_id: str) -> list[dict[str, Any]]:
    """The attributes of the job's events in which a profiler reported records it dropped."""
    t = tables.events
    query = sa.select(t.c.attributes).where(
        t.c.job_id == job_id,
        t.c.kind == "custom",
        t.c.message.startswith(schema.DROP_REPORT_PREFIX, autoescape=True),
    )
    with engine.connect() as conn:
        return [_json_object(row[0]) for row in conn.execute(query)]


def _json_object(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, dict) else {}


def read_events(engine: sa.Engine, job_id: str, limit: int) -> list[dict[str, Any]]:
    """The job's first `limit` events by time, as rows of the events table."""
    t = tables.events
    query = sa.select(t).where(t.c.job_id == job_id).order_by(t.c.ts, t.c.rank).limit(limit)
    with engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(query)]


def read_events_of_kinds(engine: sa.Engine, job_id: str, kinds: Sequence[str]) -> pl.DataFrame:
    """The job's events of these kinds: rank, ts, kind, message, attributes (JSON text),
    Arrow-native."""
    columns = ["rank", "ts", "kind", "message", "attributes"]
    query = _arrow_select(engine, tables.events, job_id, columns, one_of=("kind", list(kinds)))
    return pl.DataFrame(_fetch(engine, query))


def read_otlp_metrics(
    engine: sa.Engine, job_id: str, *, name: str | None, rank: int | None, limit: int
) -> list[dict[str, Any]]:
    """The job's first `limit` OTLP metric points by (name, rank, time), JSON decoded."""
    t = tables.otlp_metrics
    query = sa.select(t).where(t.c.job_id == job_id)
    if name is not None:
        query = query.where(t.c.name == name)
    if rank is not None:
        query = query.where(t.c.rank == rank)
    query = query.order_by(t.c.name, t.c.rank, t.c.ts, t.c.series).limit(limit)
    with engine.connect() as conn:
        rows = [dict(row._mapping) for row in conn.execute(query)]
    for row in rows:
        row["attributes"] = json.loads(row.pop("series"))
        for column in ("bounds", "bucket_counts"):
            if isinstance(row[column], str):  # written as JSON text by the bulk writer
                row[column] = json.loads(row[column])
    return rows
