"""Arrow-native reads of a job's stored records into polars, through ADBC (no row objects).

Rows come ordered by the table's natural key: steps (rank, step), collectives (rank, step,
op), gpu (rank, gpu_index, ts), events (rank, ts, kind), ranks (rank). Columns have the
canonical dtypes of `stepscope.schema` (str and json → String, int → Int64, float →
Float64) whatever the values; JSON columns are JSON text. Reads use a small pool of ADBC
connections per engine; an in-memory SQLite database is read through SQLAlchemy instead.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NamedTuple

import adbc_driver_postgresql.dbapi
import adbc_driver_sqlite.dbapi
import polars as pl
import pyarrow as pa
import sqlalchemy as sa
from adbc_driver_manager import dbapi

from stepscope import schema
from stepscope.store import tables

FRAME_TABLES: dict[str, sa.Table] = {**tables.RECORD_TABLES, "ranks": tables.ranks}
"""Frame name → table."""

_ARROW_TYPES = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "json": pa.string()}
_SQL_TYPES = {
    "sqlite": {"str": "TEXT", "int": "INTEGER", "float": "REAL", "json": "TEXT"},
    "postgresql": {"str": "text", "int": "bigint", "float": "double precision", "json": "text"},
}
_TYPED_VALUES = {"str": "''", "int": "0", "float": "0.0", "json": "''"}
_MAX_IDLE_CONNECTIONS = 8
"""Idle ADBC connections kept per engine: a PostgreSQL connect costs ~40 ms, a small read ~1 ms."""


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
    return pa.schema([(n, _ARROW_TYPES[spec.column(n).dtype]) for n in names])


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
    query = _select(engine, table, job_id, columns, from_step, to_step, ranks, from_ts, to_ts)
    uri = _adbc_uri(engine.url)
    if uri is None:
        return pl.DataFrame(_read_through_sqlalchemy(engine, query))
    with _cursor(engine, uri, query, batch_rows=65536) as cursor:  # few chunks to join
        return pl.DataFrame(_conform(cursor.fetch_arrow_table(), query))


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
    """The rows of `read_frame`, streamed as record batches of at most `batch_rows` rows."""
    if batch_rows < 1:
        raise ValueError("batch_rows must be >= 1")
    query = _select(engine, table, job_id, columns, from_step, to_step, ranks, from_ts, to_ts)
    return _stream(engine, _adbc_uri(engine.url), query, batch_rows)  # errors raised here


def _stream(
    engine: sa.Engine, uri: str | None, query: _Select, batch_rows: int
) -> Iterator[pa.RecordBatch]:
    if uri is None:  # an in-memory database: its rows are in memory anyway
        yield from _read_through_sqlalchemy(engine, query).to_batches(batch_rows)
        return
    with _cursor(engine, uri, query, batch_rows=batch_rows) as cursor:
        for i, batch in enumerate(cursor.fetch_record_batch()):
            batch = _conform(batch, query, first=i == 0)
            for start in range(0, batch.num_rows, batch_rows):
                yield batch.slice(start, batch_rows)


class _Select(NamedTuple):
    sql: str
    params: list[Any]
    schema: pa.Schema
    typing_row: bool
    """Whether the first row only types the result (SQLite) and is to be dropped."""
    setup: str | None
    """PostgreSQL: binds `params` to the transaction-local settings that `sql` reads."""


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
) -> _Select:
    """The SQL and bound parameters of a read: every filter is in the WHERE clause."""
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
        sql_type = _SQL_TYPES[dialect][spec.column(column).dtype]
        return f"CAST(current_setting('stepscope.read_{len(params)}') AS {sql_type})"

    where = [f'"job_id" = {bind(job_id, "job_id")}']
    for column, op, value in (
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
    if ranks is not None:
        # Inlined as integer literals (int() makes them safe): binding a thousand parameters
        # costs ADBC half a second, and the listed ranks let the key serve a step range.
        listed = ", ".join(str(int(r)) for r in ranks)
        where.append(f'"rank" IN ({listed})' if listed else "1 = 0")

    # Key columns (never NULL) are selected as stored, so the primary-key index gives the
    # order; the others are CAST to their type. Keys not asked for are dropped after reading.
    keys = spec.key[1:]
    names = [*target.names, *(k for k in keys if k not in target.names)]
    sql_type = {n: _SQL_TYPES[dialect][spec.column(n).dtype] for n in names}
    select = ", ".join(
        f'"{n}"' if n in keys else f'CAST("{n}" AS {sql_type[n]}) AS "{n}"' for n in names
    )
    sql = f'SELECT {select} FROM "{spec.name}" WHERE {" AND ".join(where)}'
    setup = None
    if dialect == "sqlite":
        # ADBC's SQLite driver types a column by its values in the first batch: NULL there
        # makes it int64, and a float or text later fails the read. A first row of typed
        # values fixes the types; its NULL keys sort it first (SQLite merges it in, no sort).
        typed = {n: f"CAST({_TYPED_VALUES[spec.column(n).dtype]} AS {sql_type[n]})" for n in names}
        first = ", ".join(f'{"NULL" if n in keys else typed[n]} AS "{n}"' for n in names)
        sql = f"SELECT {first} UNION ALL {sql}"
    else:
        settings = (
            f"set_config('stepscope.read_{i}', ${i}, true)" for i in range(1, len(params) + 1)
        )
        setup = f"SELECT {', '.join(settings)}"
    sql += " ORDER BY " + ", ".join(str(names.index(k) + 1) for k in keys)
    return _Select(sql, params, target, typing_row=dialect == "sqlite", setup=setup)


def _conform(data: Any, query: _Select, *, first: bool = True) -> Any:
    """An arrow table or batch of `query`'s result without the typing row, in its schema."""
    if first and query.typing_row:
        data = data.slice(1)
    arrays = [data.column(i).cast(field.type) for i, field in enumerate(query.schema)]
    return type(data).from_arrays(arrays, schema=query.schema)


def _read_through_sqlalchemy(engine: sa.Engine, query: _Select) -> pa.Table:
    """`query`'s result read row-wise through the engine's own connection."""
    # An in-memory SQLite database lives inside that connection: ADBC cannot open it.
    with engine.connect() as conn:
        rows = pl.read_database(query.sql, conn, execute_options={"parameters": query.params})
    return _conform(rows.to_arrow(), query)


# --- ADBC connections ---------------------------------------------------------------------


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


class _Pool:
    """Idle ADBC connections to one database; a connection serves one thread at a time."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._idle: list[dbapi.Connection] = []
        self._lock = threading.Lock()

    def connect(self) -> dbapi.Connection:
        # autocommit: no transaction stays open between reads, so no stale SQLite snapshot
        # and no PostgreSQL session idle in transaction.
        if self.uri.startswith("postgresql://"):
            return adbc_driver_postgresql.dbapi.connect(self.uri, autocommit=True)
        conn = adbc_driver_sqlite.dbapi.connect(self.uri, autocommit=True)
        with conn.cursor() as cursor:  # wait out a writer's lock, as the engine's connections do
            cursor.execute("PRAGMA busy_timeout = 30000")
        return conn

    @contextmanager
    def cursor(self, query: _Select, batch_rows: int) -> Iterator[dbapi.Cursor]:
        """A cursor that executed `query`; a connection that failed is closed, not reused."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        reused, conn = conn is not None, conn or self.connect()
        try:
            try:
                cursor = _execute(conn, query, batch_rows)
            except dbapi.Error:
                if not reused:
                    raise
                conn.close()  # the server may have closed it while idle: retry on a new one
                conn = self.connect()
                cursor = _execute(conn, query, batch_rows)
            try:
                yield cursor
                if query.setup is not None:
                    cursor.execute("COMMIT")
            finally:
                cursor.close()
        except BaseException:  # a stream left half-read too: that connection is not reused
            conn.close()
            raise
        with self._lock:
            if len(self._idle) < _MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def close(self, *_: Any) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


_pools: weakref.WeakKeyDictionary[sa.Engine, _Pool] = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def _cursor(
    engine: sa.Engine, uri: str, query: _Select, *, batch_rows: int
) -> AbstractContextManager[dbapi.Cursor]:
    """A pooled cursor that executed `query`; the pool is emptied by `engine.dispose()`."""
    with _pools_lock:
        pool = _pools.get(engine)
        if pool is None:
            pool = _pools[engine] = _Pool(uri)
            sa.event.listen(engine, "engine_disposed", pool.close)
            weakref.finalize(engine, pool.close)  # closes its connections with the engine
    return pool.cursor(query, batch_rows)


def _execute(conn: dbapi.Connection, query: _Select, batch_rows: int) -> dbapi.Cursor:
    """A cursor of `conn` that executed `query` (closed if that failed)."""
    cursor = conn.cursor()
    try:
        if query.typing_row:  # >= 2: the first batch must hold a stored row after the typing row
            options = {"adbc.sqlite.query.batch_rows": str(max(batch_rows, 2))}
            cursor.adbc_statement.set_options(**options)
        if query.setup is None:
            return cursor.execute(query.sql, query.params)
        cursor.execute("BEGIN")  # committed by _Pool.cursor once the result is read
        cursor.execute(query.setup, query.params)
        cursor.fetchall()
        return cursor.execute(query.sql)
    except BaseException:
        cursor.close()
        raise
