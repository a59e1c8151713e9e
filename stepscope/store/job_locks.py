"""One analysis pass per job at a time, across threads and server replicas.

On PostgreSQL a session-level advisory lock per job, held on a connection of its own for the
pass: a replica that dies (or loses its connection) releases it with its session, so another
replica takes the job over at its next pass. Before it, and alone on SQLite (which one
server owns), a lock per engine and job serves the threads of one process.
"""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

_POLL_S = 0.1
_local_guard = threading.Lock()
_local: weakref.WeakKeyDictionary[sa.Engine, dict[str, threading.Lock]] = (
    weakref.WeakKeyDictionary()
)
"""Per engine (one server, or one command, holds one): the lock of each job its passes took."""


def lock_key(job_id: str) -> int:
    """The job's advisory lock key: a stable signed 64-bit hash of the namespaced job id."""
    digest = hashlib.blake2b(f"stepscope.pass:{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _local_lock(engine: sa.Engine, job_id: str) -> threading.Lock:
    with _local_guard:
        return _local.setdefault(engine, {}).setdefault(job_id, threading.Lock())


@contextmanager
def job_lock(engine: sa.Engine, job_id: str, *, wait_s: float = 0.0) -> Iterator[bool]:
    """Hold the job's pass lock while the block runs; yields False, holding nothing, when
    another thread or process kept it for `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    local = _local_lock(engine, job_id)
    acquired = local.acquire(timeout=wait_s) if wait_s > 0 else local.acquire(blocking=False)
    if not acquired:
        yield False
        return
    try:
        if engine.dialect.name != "postgresql":
            yield True
            return
        with engine.connect() as conn:
            held = _try_advisory(conn, job_id, deadline)
            try:
                yield held
            finally:
                if held:
                    _unlock(conn, job_id)
    finally:
        local.release()


def _try_advisory(conn: sa.Connection, job_id: str, deadline: float) -> bool:
    key = {"key": lock_key(job_id)}
    while True:
        held = bool(conn.execute(sa.text("SELECT pg_try_advisory_lock(:key)"), key).scalar())
        conn.commit()  # the lock outlives the transaction; the connection must not idle in one
        if held or time.monotonic() >= deadline:
            return held
        time.sleep(_POLL_S)


def _unlock(conn: sa.Connection, job_id: str) -> None:
    try:
        conn.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": lock_key(job_id)})
        conn.commit()
    except sa.exc.DBAPIError:
        conn.invalidate()  # the session, and with it the lock, is gone or going
