"""Arrow-native reads of a job's stored records into polars, through ADBC (no row objects).

Rows come ordered by the table's natural key: steps (rank, step), collectives (rank, step,
group, op), gpu (rank, gpu_index, ts), events (rank, ts, kind), ranks (rank). Columns have the
canonical dtypes of `stepscope.schema` (str and json → String, int → Int64, float →
Float64) whatever the values; JSON columns are JSON text. PostgreSQL reads use a small
pool of ADBC connections per engine (stepscope.store.pg_reader); SQLite files are read by
ADBC in a helper process (see stepscope.store.sqlite_reader for why), an in-memory SQLite
database through SQLAlchemy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple

import polars as pl
import pyarrow as pa
import sqlalchemy as sa

from stepscope import schema
from stepscope.store import pg_reader, sqlite_reader, tables
from stepscope.store.arrow_sql import ARROW_TYPES, SQL_TYPES, keyed_select

FRAME_TABLES: dict[str, sa.Table] = {**tables.RECORD_TABLES, "ranks": tables.ranks}
"""Frame name → table."""

ROWS_PER_READ = 131072
"""Rows a streamed read fetches at a time (a whole rank if it has more)."""
_READS_IN_FLIGHT = 2
"""Reads of a streamed table running at once (PostgreSQL connections or SQLite readers)."""
_BATCH_COUNTS = {
    "steps": "num_steps",
    "collectives": "num_collectives",
    "gpu": "num_gpu",
    "events": "num_events",
}
"""Frame table → the column of ingest_batches that counts its rows."""


def arrow_schema(table: str, columns: Sequence[str] | None = None) -> pa.Schema:
    """The canonical arrow schema of `columns` (default: all stored columns) of a frame table."""
    if table not in FRAME_TABLES:
        raise ValueError(f"unknown table {table!r}; tables are {', '.join(FRAME_TABLES)}")
    stored = FRAME_TABLES[table].c
    names = list(stored.keys()) if columns is None else list(columns)
    unknown = [n for n in names if n not in stored]
    if unknown or not names or len(set(names)) < len(names):
        what = f"no column {', '.join(map(repr, unknown))}" if unknown else "no or repeated columns"
        raise ValueError(f"{table} has {what}; its columns are {', '.join(stored.keys())}")
    spec = schema.TABLES[FRAME_TABLES[table].name]
    return pa.schema([(n, ARROW_TYPES[spec.column(n).dtype]) for n in names])


def read_frame(
    engine: sa.Engine,
    table: str,
    job_id: str,
    *,
    columns: Sequence[str] | None = None,
    from_step: int | None = None,
    to_step: int | None = None,
    ranks: Sequence[int] | None = None,
    from_ts: float | None = None,
    to_ts: float | None = None,
) -> pl.DataFrame:
    """The job's rows of `table` with step in [from_step, to_step], ts in [from_ts, to_ts)."""
    filters = (engine, table, job_id, columns, from_step, to_step, ranks, from_ts, to_ts)
    query = _select(*filters)
    whole_table = (ranks, from_step, to_step, from_ts, to_ts) == (None,) * 5
    if whole_table and table != "ranks" and _is_sqlite_file(engine):
        # One SQLite reader decodes on one core: a job's whole table is read by two, a range
        # of ranks at a time (~1.8x as fast for 3M step rows).
        batches = iter_batches(engine, table, job_id, columns=columns, batch_rows=ROWS_PER_READ)
        return pl.DataFrame(pa.Table.from_batches(list(batches), schema=query.schema))
    unfilled = _unfilled_columns(engine, table, job_id)
    data, _ = _read_filled(engine, table, job_id, partial(_select, *filters), unfilled)
    return pl.DataFrame(data)


def _is_sqlite_file(engine: sa.Engine) -> bool:
    return engine.dialect.name == "sqlite" and _adbc_uri(engine.url) is not None


def fetch_table(engine: sa.Engine, query: Select) -> pa.Table:
    """`query`'s whole result in its schema: from PostgreSQL through pooled ADBC connections,
    from a SQLite file through the reader process (stepscope.store.sqlite_reader), from an
    in-memory SQLite database row-wise through SQLAlchemy."""
    uri = _adbc_uri(engine.url)
    if uri is None:
        return _read_through_sqlalchemy(engine, query)
    if engine.dialect.name == "sqlite":
        data = sqlite_reader.fetch(uri, query.sql, query.params, typing_row=query.typing_row)
        return _conform(data, query)
    with pg_reader.cursor(engine, uri, query.sql, query.params, query.setup) as cursor:
        return _conform(cursor.fetch_arrow_table(), query)


def iter_batches(
    engine: sa.Engine,
    table: str,
    job_id: str,
    *,
    columns: Sequence[str] | None = None,
    batch_rows: int = 65536,
    from_step: int | None = None,
    to_step: int | None = None,
    ranks: Sequence[int] | None = None,
    from_ts: float | None = None,
    to_ts: float | None = None,
) -> Iterator[pa.RecordBatch]:
    """The rows of `read_frame`, streamed as record batches of at most `batch_rows` rows.

    They are read a few ranks at a time (about ROWS_PER_READ rows, or one rank), two reads
    in flight: the next read runs on the database (or the SQLite reader process) while this
    one is consumed, and memory stays bounded whatever the job's size.
    """
    if batch_rows < 1:
        raise ValueError("batch_rows must be >= 1")
    # errors raised here, not at the first batch
    _select(engine, table, job_id, columns, from_step, to_step, ranks, from_ts, to_ts)
    per_read = max(1, ROWS_PER_READ // _rows_per_rank(engine, table, job_id))
    filters = (engine, table, job_id, columns, from_step, to_step)
    chunks: list[Callable[[frozenset[str]], Select]]
    if ranks is None:  # the job's ranks, a range of them a read: along the key, no sort
        job_ranks = read_frame(engine, "ranks", job_id, columns=["rank"])["rank"].to_list()
        chunks = [
            partial(_select, *filters, None, from_ts, to_ts, rank_range=(part[0], part[-1]))
            for part in _parts(job_ranks, per_read)
        ]
    else:
        listed = sorted(set(ranks))
        chunks = [
            partial(_select, *filters, part, from_ts, to_ts) for part in _parts(listed, per_read)
        ]
    return _fetched_in_order(engine, table, job_id, chunks, batch_rows)


def _parts(values: list[int], size: int) -> list[list[int]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


def _rows_per_rank(engine: sa.Engine, table: str, job_id: str) -> int:
    """The job's mean rows of `table` per rank as its batches counted them (at least 1)."""
    if table == "ranks":
        return 1
    batch = tables.IngestBatch
    counted = getattr(batch, _BATCH_COUNTS[table])
    query = sa.select(sa.func.sum(counted), sa.func.count(sa.distinct(batch.rank))).where(
        batch.job_id == job_id
    )
    with engine.connect() as conn:
        total, num_ranks = conn.execute(query).one()
    return max(1, int(total or 0) // max(1, int(num_ranks)))


def _fetched_in_order(
    engine: sa.Engine,
    table: str,
    job_id: str,
    chunks: list[Callable[[frozenset[str]], Select]],
    batch_rows: int,
) -> Iterator[pa.RecordBatch]:
    """The chunks' rows in order, the next chunk read while this one is consumed."""
    unfilled = _unfilled_columns(engine, table, job_id)

    def read(chunk: Callable[[frozenset[str]], Select]) -> pa.Table:
        nonlocal unfilled
        data, unfilled = _read_filled(engine, table, job_id, chunk, unfilled)
        return data

    with ThreadPoolExecutor(max_workers=_READS_IN_FLIGHT) as pool:
        pending: deque[Future[pa.Table]] = deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(read, chunk))
                if len(pending) < _READS_IN_FLIGHT:
                    continue
                yield from pending.popleft().result().to_batches(max_chunksize=batch_rows)
            while pending:
                yield from pending.popleft().result().to_batches(max_chunksize=batch_rows)
        finally:
            for future in pending:
                future.cancel()


def _unfilled_columns(engine: sa.Engine, table: str, job_id: str) -> frozenset[str]:
    """The optional columns of `table` in which the job has stored no value (job_columns)."""
    if table not in tables.RECORD_TABLES:
        return frozenset()
    jc = tables.job_columns
    query = sa.select(jc.c.column_name).where(
        jc.c.job_id == job_id, jc.c.table_name == FRAME_TABLES[table].name
    )
    with engine.connect() as conn:
        filled = set(conn.execute(query).scalars())
    return frozenset(tables.OPTIONAL_COLUMNS[table]) - filled


def _read_filled(
    engine: sa.Engine,
    table: str,
    job_id: str,
    select: Callable[[frozenset[str]], Select],
    unfilled: frozenset[str],
) -> tuple[pa.Table, frozenset[str]]:
    """The rows of `select(unfilled)`, whose columns in `unfilled` are not read but null, and
    the job's unfilled columns after the read. A value stored meanwhile in one of them (the
    rows and job_columns commit together) makes the read run again with that column."""
    while True:
        data = fetch_table(engine, select(unfilled))
        if not unfilled:
            return data, unfilled
        after = _unfilled_columns(engine, table, job_id)
        if unfilled <= after:
            return data, after
        unfilled = after


class Select(NamedTuple):
    """A read: SQL, its bound parameters and the arrow schema of its result."""

    sql: str
    params: list[Any]
    schema: pa.Schema
    typing_row: bool
    """Whether the first row only types the result (SQLite) and is to be dropped."""
    setup: str | None
    """PostgreSQL: binds `params` to the transaction-local settings that `sql` reads."""
    unread: tuple[str, ...] = ()
    """Columns of `schema` not read: null in every row of the job."""


def _select(
    engine: sa.Engine,
    table: str,
    job_id: str,
    columns: Sequence[str] | None,
    from_step: int | None,
    to_step: int | None,
    ranks: Sequence[int] | None,
    from_ts: float | None,
    to_ts: float | None,
    unfilled: frozenset[str] = frozenset(),
    *,
    rank_range: tuple[int, int] | None = None,
) -> Select:
    """The SQL and bound parameters of a read: every filter is in the WHERE clause; columns
    in `unfilled` (null in every row of the job) are not read but filled with nulls."""
    target = arrow_schema(table, columns)
    dialect = engine.dialect.name
    spec = schema.TABLES[FRAME_TABLES[table].name]
    params: list[Any] = []

    def bind(value: Any, column: str) -> str:
        if dialect == "sqlite":
            params.append(value)
            return "?"
        # ADBC reads a PostgreSQL query without parameters through COPY, ~1.7x as fast: the
        # values are bound to transaction-local settings first, and the query reads those.
        params.append(str(value))  # str(float) round-trips exactly
        sql_type = SQL_TYPES[dialect][spec.column(column).dtype]
        return f"CAST(current_setting('stepscope.read_{len(params)}') AS {sql_type})"

    where = [f'"job_id" = {bind(job_id, "job_id")}']
    first_rank, last_rank = rank_range or (None, None)
    for column, op, value in (
        ("rank", ">=", None if first_rank is None else int(first_rank)),
        ("rank", "<=", None if last_rank is None else int(last_rank)),
        ("step", ">=", None if from_step is None else int(from_step)),
        ("step", "<=", None if to_step is None else int(to_step)),
        ("ts", ">=", None if from_ts is None else float(from_ts)),
        ("ts", "<", None if to_ts is None else float(to_ts)),
    ):
        if value is None:
            continue
        if column not in FRAME_TABLES[table].c:
            raise ValueError(f"{table} has no {column} column to filter on")
        where.append(f'"{column}" {op} {bind(value, column)}')
    source = f'"{spec.name}"'
    if ranks is not None:
        # Inlined as integer literals (int() makes them safe): binding a thousand parameters
        # costs ADBC half a second, and the listed ranks let the key serve a step range.
        listed = ", ".join(str(int(r)) for r in sorted(set(ranks)))
        if not listed:
            where.append("1 = 0")
        elif dialect == "sqlite":
            where.append(f'"rank" IN ({listed})')
        else:
            # One key lookup per rank. Given `rank IN (...)`, PostgreSQL's planner, whose
            # statistics do not know a live job's newest steps yet, scans every step of
            # the job's key range and filters the ranks (10x slower for a job's last steps).
            where.append('"rank" = "_listed"."_rank"')
            inner = f'SELECT * FROM "{spec.name}" WHERE {" AND ".join(where)} OFFSET 0'
            source = (
                f'unnest(\'{{{listed}}}\'::bigint[]) AS "_listed"("_rank") '
                f'CROSS JOIN LATERAL ({inner}) AS "_rows"'
            )
            where = ["TRUE"]

    # Keys not asked for are read for the order and dropped after reading.
    read = {n: spec.column(n).dtype for n in target.names if n not in unfilled}
    sql = keyed_select(dialect, source, where, read, spec.key[1:])
    setup = None
    if dialect != "sqlite":
        settings = (
            f"set_config('stepscope.read_{i}', ${i}, true)" for i in range(1, len(params) + 1)
        )
        setup = f"SELECT {', '.join(settings)}"
    skipped = tuple(n for n in target.names if n in unfilled)
    return Select(sql, params, target, dialect == "sqlite", setup, unread=skipped)


def _conform(data: pa.Table, query: Select) -> pa.Table:
    """`query`'s result without the typing row, in its schema."""
    if query.typing_row:
        data = data.slice(1)
    read = iter(data.columns)  # the columns read come first, in the schema's order
    arrays = [
        pa.nulls(data.num_rows, field.type)
        if field.name in query.unread
        else next(read).cast(field.type)
        for field in query.schema
    ]
    return pa.Table.from_arrays(arrays, schema=query.schema)


def _read_through_sqlalchemy(engine: sa.Engine, query: Select) -> pa.Table:
    """`query`'s result read row-wise through the engine's own connection."""
    # An in-memory SQLite database lives inside that connection: ADBC cannot open it.
    with engine.connect() as conn:
        rows = pl.read_database(query.sql, conn, execute_options={"parameters": query.params})
    return _conform(rows.to_arrow(), query)


def _adbc_uri(url: sa.URL) -> str | None:
    """The ADBC URI of a PostgreSQL or SQLite-file database; None for in-memory SQLite."""
    backend = url.get_backend_name()
    if backend == "postgresql":  # a libpq URI: without the SQLAlchemy driver name
        return url.set(drivername="postgresql").render_as_string(hide_password=False)
    if backend != "sqlite":
        raise ValueError(f"no Arrow reader for {backend} databases, only SQLite and PostgreSQL")
    if url.database in (None, "", ":memory:") or url.query.get("mode") == "memory":
        return None
    return url.database
