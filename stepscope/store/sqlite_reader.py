"""Arrow-native reads of SQLite files, run in one helper process.

ADBC's SQLite driver carries its own copy of the SQLite library. Two copies in one process
break SQLite's locking: POSIX locks belong to the process, so neither copy sees the other's,
each takes the WAL shared-memory file for unused, truncates it when it opens the database
first and checkpoints under the other's readers (a SIGBUS in the server's sqlite3 was seen
here). The server writes through Python's sqlite3, so its ADBC reads of SQLite run in a
separate process, spawned on first use, which returns each result as Arrow IPC.
"""

from __future__ import annotations

import atexit
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pyarrow as pa

_executor: ProcessPoolExecutor | None = None
_lock = threading.Lock()
_connections: dict[str, Any] = {}
"""In the reader process: one ADBC connection per database file."""


def fetch(uri: str, sql: str, params: list[Any], *, typing_row: bool) -> pa.Table:
    """The result of `sql` on the SQLite file `uri`, read by ADBC in the reader process."""
    for attempt in (1, 2):
        try:
            data = _reader().submit(_read, uri, sql, params, typing_row).result()
            break
        except BrokenProcessPool:  # the reader died (killed, out of memory): start another
            _reset()
            if attempt == 2:
                raise
    return pa.ipc.open_stream(data).read_all()


def _reader() -> ProcessPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            context = multiprocessing.get_context("spawn")  # no copy of the server's threads
            _executor = ProcessPoolExecutor(max_workers=1, mp_context=context)
        return _executor


def _reset() -> None:
    global _executor
    with _lock:
        if _executor is not None:
            _executor.shutdown(wait=False, cancel_futures=True)
        _executor = None


atexit.register(_reset)


def _read(uri: str, sql: str, params: list[Any], typing_row: bool) -> bytes:
    """In the reader process: run `sql` and return its result as an Arrow IPC stream."""
    import adbc_driver_sqlite.dbapi

    conn = _connections.get(uri)
    if conn is None:
        conn = _connections[uri] = adbc_driver_sqlite.dbapi.connect(uri, autocommit=True)
        with conn.cursor() as cursor:  # wait out a writer's lock, as the server's sqlite3 does
            cursor.execute("PRAGMA busy_timeout = 30000")
    with conn.cursor() as cursor:
        if typing_row:  # the first batch, which types each column, must reach a stored row
            cursor.adbc_statement.set_options(**{"adbc.sqlite.query.batch_rows": "65536"})
        cursor.execute(sql, params)
        table = cursor.fetch_arrow_table()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
