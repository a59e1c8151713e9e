"""Pooled ADBC connections to PostgreSQL, for the Arrow reads of stepscope.store.frames.

A PostgreSQL connect costs ~40 ms and a small read ~1 ms, so each engine keeps a few idle
connections, in autocommit (no session stays idle in a transaction between reads). A
connection that failed, or whose result was left half-read, is closed, not reused.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import adbc_driver_postgresql.dbapi
import sqlalchemy as sa
from adbc_driver_manager import dbapi

_MAX_IDLE_CONNECTIONS = 8
"""Idle ADBC connections kept per engine."""


class _Pool:
    """Idle ADBC connections to one database; a connection serves one thread at a time."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._idle: list[dbapi.Connection] = []
        self._lock = threading.Lock()

    def connect(self) -> dbapi.Connection:
        # autocommit: no PostgreSQL session stays idle in transaction between reads.
        return adbc_driver_postgresql.dbapi.connect(self.uri, autocommit=True)

    @contextmanager
    def cursor(self, sql: str, params: list[Any], setup: str | None) -> Iterator[dbapi.Cursor]:
        """A cursor that executed `sql`; a connection that failed is closed, not reused."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        reused, conn = conn is not None, conn or self.connect()
        try:
            try:
                cursor = _execute(conn, sql, params, setup)
            except dbapi.Error:
                if not reused:
                    raise
                conn.close()  # the server may have closed it while idle: retry on a new one
                conn = self.connect()
                cursor = _execute(conn, sql, params, setup)
            try:
                yield cursor
                if setup is not None:
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


def cursor(
    engine: sa.Engine, uri: str, sql: str, params: list[Any], setup: str | None
) -> AbstractContextManager[dbapi.Cursor]:
    """A pooled cursor of the database at `uri` that executed `sql` with `params` (after
    `setup` in the same transaction, if given); the pool is emptied by `engine.dispose()`."""
    with _pools_lock:
        pool = _pools.get(engine)
        if pool is None:
            pool = _pools[engine] = _Pool(uri)
            sa.event.listen(engine, "engine_disposed", pool.close)
            weakref.finalize(engine, pool.close)  # closes its connections with the engine
    return pool.cursor(sql, params, setup)


def _execute(
    conn: dbapi.Connection, sql: str, params: list[Any], setup: str | None
) -> dbapi.Cursor:
    """A cursor of `conn` that executed `sql` (closed if that failed)."""
    cursor = conn.cursor()
    try:
        if setup is None:
            return cursor.execute(sql, params)
        cursor.execute("BEGIN")  # committed by _Pool.cursor once the result is read
        cursor.execute(setup, params)
        cursor.fetchall()
        return cursor.execute(sql)
    except BaseException:
        cursor.close()
        raise
