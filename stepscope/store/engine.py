"""Engine construction for the embedded SQLite default and PostgreSQL."""

from __future__ import annotations

import sqlite3
from typing import Any

import sqlalchemy as sa

DEFAULT_DATABASE_URL = "sqlite:///./stepscope.db"


def normalize_url(url: str) -> str:
    """Map plain `postgresql://` URLs onto the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def is_sqlite(engine: sa.Engine) -> bool:
    return engine.dialect.name == "sqlite"


def _sqlite_pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def make_engine(url: str = DEFAULT_DATABASE_URL) -> sa.Engine:
    """An engine with WAL for SQLite and a pooled psycopg 3 connection for PostgreSQL."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"check_same_thread": False})
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return sa.create_engine(url, pool_size=8, max_overflow=8, pool_pre_ping=True)


def ping(engine: sa.Engine) -> None:
    """Raise unless the database answers a trivial query."""
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
