"""Which database errors mean "unavailable for now" (retry later) rather than a bug."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from typing import Any

import sqlalchemy as sa

log = logging.getLogger(__name__)

_PG_UNAVAILABLE_CLASSES = ("08", "53", "57P")
"""SQLSTATE prefixes: connection exceptions, insufficient resources (too many connections),
operator intervention (admin/crash shutdown, cannot connect now)."""
_PG_RETRYABLE = ("40001", "40P01", "55P03")
"""Serialization failure, deadlock, lock not available: the same request succeeds later."""
_SQLITE_BUSY = ("database is locked", "database is busy", "database table is locked")


def is_unavailable(exc: BaseException) -> bool:
    """True when `exc` says the database cannot answer now (down, restarting, refusing
    connections, locked), so the same request will succeed later."""
    if isinstance(exc, sa.exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        return _is_unavailable_driver_error(exc.orig)
    if isinstance(exc, sa.exc.TimeoutError):  # the pool is exhausted by a stuck database
        return True
    return _is_unavailable_driver_error(exc)


def _is_unavailable_driver_error(exc: BaseException | None) -> bool:
    if isinstance(exc, sqlite3.OperationalError):
        message = str(exc).lower()
        return any(busy in message for busy in _SQLITE_BUSY)
    try:  # the server extra installs both: psycopg writes, ADBC reads (store.pg_reader)
        import adbc_driver_manager
        import psycopg
    except ImportError:  # pragma: no cover
        return False
    lost: tuple[type[Exception], ...]
    if isinstance(exc, psycopg.Error):
        lost = (psycopg.OperationalError, psycopg.InterfaceError)
    elif isinstance(exc, adbc_driver_manager.Error):
        lost = (adbc_driver_manager.OperationalError, adbc_driver_manager.InterfaceError)
    else:
        return False
    state = exc.sqlstate
    if state is None:
        # No SQLSTATE: the client failed to connect or lost the connection.
        return isinstance(exc, lost)
    return state.startswith(_PG_UNAVAILABLE_CLASSES) or state in _PG_RETRYABLE


def unavailable_reason(exc: BaseException) -> str:
    """One line naming why the database is unavailable (for logs and 503 bodies)."""
    orig = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
    text = " ".join(str(orig).split()) or type(orig).__name__
    return text[:200]


class OutageLog:
    """Logs one line when the database becomes unavailable and one when it answers again,
    however many requests and threads meet the outage in between."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None
        self._num_failures = 0

    @property
    def ongoing(self) -> bool:
        """True between a failure and the next success."""
        return self._since is not None

    def unavailable(self, exc: BaseException) -> None:
        """Note one operation that failed because the database is unavailable."""
        with self._lock:
            self._num_failures += 1
            if self._since is not None:
                return
            self._since = time.monotonic()
        log.warning(
            "database unavailable (%s): answering 503 and retrying until it is back",
            unavailable_reason(exc),
        )

    def failed(self, exc: BaseException, logger: logging.Logger, message: str, *args: Any) -> None:
        """Log a background operation that failed: the outage's one line when the database is
        unavailable, else `message` with the traceback."""
        if is_unavailable(exc):
            self.unavailable(exc)
        else:
            logger.error(message, *args, exc_info=exc)

    def available(self) -> None:
        """Note one operation that succeeded; ends an outage (cheap when there is none)."""
        if self._since is None:
            return
        with self._lock:
            if self._since is None:
                return
            down_s, num_failures = time.monotonic() - self._since, self._num_failures
            self._since, self._num_failures = None, 0
        log.warning(
            "database available again after %.1f s (%d operations failed meanwhile)",
            down_s,
            num_failures,
        )


OUTAGES = OutageLog()
"""This process's outage log: the writer, the passes, the webhooks and the API share it."""
