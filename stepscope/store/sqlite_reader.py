"""Arrow-native reads of SQLite files, run in helper processes.

ADBC's SQLite driver carries its own copy of the SQLite library. Two copies in one process
break SQLite's locking: POSIX locks belong to the process, so neither copy sees the other's,
each takes the WAL shared-memory file for unused, truncates it when it opens the database
first and checkpoints under the other's readers (a SIGBUS in the server's sqlite3 was seen
here). The server writes through Python's sqlite3, so its ADBC reads of SQLite run in
separate processes (`python -m stepscope.store.sqlite_reader`, started on first use). Each
result comes back as an Arrow IPC file in shared memory, which this process maps.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
from typing import Any, BinaryIO

import pyarrow as pa

_SPOOL = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
"""Where results pass from a reader process: memory, where the system has it."""
_MAX_IDLE_READERS = 4


class ReadError(RuntimeError):
    """A reader process could not run a query; its message says why."""


def fetch(uri: str, sql: str, params: list[Any], *, typing_row: bool) -> pa.Table:
    """The result of `sql` on the SQLite file `uri`, read by ADBC in a reader process."""
    request = (uri, sql, params, typing_row)
    for attempt in (1, 2):
        reader = _take()
        try:
            reply = reader.call(request)
        except (EOFError, OSError, pickle.UnpicklingError):  # it died: retry on a new one
            reader.close()
            if attempt == 2:
                raise
            continue
        _give_back(reader)
        if isinstance(reply, ReadError):
            raise reply
        break
    try:
        with pa.memory_map(reply) as source:  # the table keeps the mapping alive
            return pa.ipc.open_file(source).read_all()
    finally:
        os.unlink(reply)


class _Reader:
    """One reader process and its request/reply pipes (pickled tuples)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stepscope.store.sqlite_reader"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def call(self, request: tuple[Any, ...]) -> Any:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        pickle.dump(request, self.proc.stdin)
        self.proc.stdin.flush()
        return pickle.load(self.proc.stdout)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the reader exits at the end of its input
        self.proc.wait(timeout=10)


_idle: list[_Reader] = []
_lock = threading.Lock()


def _take() -> _Reader:
    with _lock:
        if _idle:
            return _idle.pop()
    return _Reader()


def _give_back(reader: _Reader) -> None:
    with _lock:
        if len(_idle) < _MAX_IDLE_READERS:
            _idle.append(reader)
            return
    reader.close()


# --- in the reader process ----------------------------------------------------------------


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """Answer pickled (uri, sql, params, typing_row) requests until the input ends."""
    import adbc_driver_sqlite.dbapi

    connections: dict[str, Any] = {}
    while True:
        try:
            uri, sql, params, typing_row = pickle.load(requests)
        except EOFError:
            return
        try:
            conn = connections.get(uri)
            if conn is None:
                conn = connections[uri] = adbc_driver_sqlite.dbapi.connect(uri, autocommit=True)
                with conn.cursor() as cursor:  # wait out a writer's lock, as sqlite3 does
                    cursor.execute("PRAGMA busy_timeout = 30000")
            reply: Any = _read(conn, sql, params, typing_row)
        except Exception as exc:  # the caller raises it
            reply = ReadError(f"{type(exc).__name__}: {exc}")
        pickle.dump(reply, replies)
        replies.flush()


def _read(conn: Any, sql: str, params: list[Any], typing_row: bool) -> str:
    """Run `sql`; the path of its result as an Arrow IPC file in the spool."""
    with conn.cursor() as cursor:
        if typing_row:  # the first batch, which types each column, must reach a stored row
            cursor.adbc_statement.set_options(**{"adbc.sqlite.query.batch_rows": "65536"})
        cursor.execute(sql, params)
        table = cursor.fetch_arrow_table()
    handle, path = tempfile.mkstemp(prefix="stepscope-read-", suffix=".arrow", dir=_SPOOL)
    with os.fdopen(handle, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
