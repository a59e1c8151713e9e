"""Bulk writes: one transaction per batch; SQLite executemany, PostgreSQL binary COPY."""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from stepscope.store import tables
from stepscope.store.engine import is_sqlite

_PG_STAGE_TYPES = {sa.String: "text", sa.BigInteger: "int8", sa.Integer: "int8", sa.Float: "float8"}


@dataclass(frozen=True, slots=True)
class WriteResult:
    accepted: dict[str, int]
    duplicate: bool


def _pg_type(column: sa.Column[Any]) -> str:
    for sa_type, pg_name in _PG_STAGE_TYPES.items():
        if isinstance(column.type, sa_type):
            return pg_name
    return "text"  # JSON travels as text and is cast on insert


def insert_ignoring_duplicates(conn: sa.Connection, table: sa.Table, frame: pl.DataFrame) -> None:
    """Insert all rows of `frame`; rows whose natural key is already stored are skipped."""
    columns = [c for c in table.columns if c.name in frame.columns]
    names = [c.name for c in columns]
    frame = frame.select(names)
    quoted = ", ".join(f'"{n}"' for n in names)
    if conn.dialect.name == "sqlite":
        placeholders = ", ".join("?" for _ in names)
        conn.exec_driver_sql(
            f'INSERT OR IGNORE INTO "{table.name}" ({quoted}) VALUES ({placeholders})', frame.rows()
        )
        return
    stage = f"_stage_{table.name}"
    stage_columns = ", ".join(f'"{c.name}" {_pg_type(c)}' for c in table.columns if c.name != "id")
    casts = ", ".join(
        f'"{c.name}"::json' if isinstance(c.type, sa.JSON) else f'"{c.name}"' for c in columns
    )
    types = [_pg_type(c) for c in columns]
    raw = conn.connection.driver_connection
    assert raw is not None
    with raw.cursor() as cur:
        cur.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {stage} ({stage_columns}) ON COMMIT DELETE ROWS"
        )
        with cur.copy(f"COPY {stage} ({quoted}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(types)
            for row in frame.iter_rows():
                copy.write_row(row)
        cur.execute(
            f'INSERT INTO "{table.name}" ({quoted}) '
            f"SELECT {casts} FROM {stage} ON CONFLICT DO NOTHING"
        )


class BatchWriter:
    """Writes validated wire batches; safe to call from many threads."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        # SQLite has one writer at a time: queue in-process instead of spinning on busy_timeout.
        self._write_lock: AbstractContextManager[Any] = (
            threading.Lock() if is_sqlite(engine) else nullcontext()
        )
        self._insert = sqlite.insert if is_sqlite(engine) else postgresql.insert

    def write(
        self,
        *,
        job: dict[str, Any],
        source: dict[str, Any],
        seq: int,
        frames: dict[str, pl.DataFrame],
    ) -> WriteResult:
        """Store a whole batch in one transaction, or nothing if its key was already stored."""
        counts = {
            name: frames[name].height if name in frames else 0 for name in tables.RECORD_TABLES
        }
        now = time.time()
        key = {
            "job_id": job["job_id"],
            "rank": source["rank"],
            "incarnation": source["incarnation"],
        }
        with self._write_lock, self.engine.begin() as conn:
            claimed = conn.execute(
                self._insert(tables.IngestBatch.__table__)
                .values(
                    **key,
                    seq=seq,
                    received_at=now,
                    num_steps=counts["steps"],
                    num_collectives=counts["collectives"],
                    num_gpu=counts["gpu"],
                    num_events=counts["events"],
                )
                .on_conflict_do_nothing()
                .returning(tables.IngestBatch.seq)
            ).first()
            if claimed is None:
                return WriteResult(accepted=self._stored_counts(conn, key, seq), duplicate=True)
            self._upsert_job(conn, job, frames, now)
            self._upsert_rank(conn, job["job_id"], source, now)
            for name, frame in frames.items():
                insert_ignoring_duplicates(conn, tables.RECORD_TABLES[name], frame)
        return WriteResult(accepted=counts, duplicate=False)

    def _stored_counts(self, conn: sa.Connection, key: dict[str, Any], seq: int) -> dict[str, int]:
        t = tables.IngestBatch
        row = conn.execute(
            sa.select(t.num_steps, t.num_collectives, t.num_gpu, t.num_events).where(
                t.job_id == key["job_id"],
                t.rank == key["rank"],
                t.incarnation == key["incarnation"],
                t.seq == seq,
            )
        ).one()
        return dict(zip(tables.RECORD_TABLES, row, strict=True))

    def _upsert_job(
        self, conn: sa.Connection, job: dict[str, Any], frames: dict[str, pl.DataFrame], now: float
    ) -> None:
        given = {k: v for k, v in job.items() if v is not None}
        started_at = frames["steps"]["ts"].min() if "steps" in frames else None
        insert = self._insert(tables.jobs).values(
            status="running", **given, started_at=given.get("started_at", started_at or now)
        )
        updates = {k: insert.excluded[k] for k in given if k not in ("job_id", "started_at")}
        conn.execute(
            insert.on_conflict_do_update(index_elements=["job_id"], set_=updates)
            if updates
            else insert.on_conflict_do_nothing()
        )

    def _upsert_rank(
        self, conn: sa.Connection, job_id: str, source: dict[str, Any], now: float
    ) -> None:
        insert = self._insert(tables.ranks).values(
            job_id=job_id,
            rank=source["rank"],
            local_rank=source.get("local_rank"),
            node=source.get("node"),
            pid=source.get("pid"),
            incarnation=source["incarnation"],
            first_seen=now,
            last_seen=now,
        )
        changed = ("local_rank", "node", "pid", "incarnation", "last_seen")
        conn.execute(
            insert.on_conflict_do_update(
                index_elements=["job_id", "rank"], set_={k: insert.excluded[k] for k in changed}
            )
        )
