"""Engine construction for the embedded SQLite default and PostgreSQL."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

DEFAULT_DATABASE_URL = "sqlite:///./stepscope.db"
SQLITE_BUSY_TIMEOUT_S = 30.0
"""How long a SQLite write waits for another writer's lock before "database is locked"."""
PG_CONNECT_TIMEOUT_S = 5
"""Longest wait for a new PostgreSQL connection, in seconds."""


def normalize_url(url: str) -> str:
    """Map plain `postgresql://` URLs onto the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def is_sqlite(engine: sa.Engine) -> bool:
    return engine.dialect.name == "sqlite"


def _sqlite_pragmas(busy_timeout_s: float) -> Callable[[sqlite3.Connection, Any], None]:
    def on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cur.close()

    return on_connect


def make_engine(
    url: str = DEFAULT_DATABASE_URL, *, sqlite_busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S
) -> sa.Engine:
    """An engine with WAL for SQLite and a pooled psycopg 3 connection for PostgreSQL."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"check_same_thread": False})
        sa.event.listen(engine, "connect", _sqlite_pragmas(sqlite_busy_timeout_s))
        return engine
    # A bounded connect: an unreachable host must turn into a 503, not a stalled request.
    return sa.create_engine(
        url,
        pool_size=8,
        max_overflow=8,
        pool_pre_ping=True,
        connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S},
    )


def ping(engine: sa.Engine) -> None:
    """Raise unless the database answers a trivial query."""
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
