"""Bulk writes: one transaction per batch; SQLite executemany, PostgreSQL binary COPY."""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

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


def insert_ignoring_duplicates(
    conn: sa.Connection, table: sa.Table, values: dict[str, list[Any]]
) -> None:
    """Insert rows given as columns; rows whose natural key is already stored are skipped."""
    columns = [c for c in table.columns if c.name in values]
    names = [c.name for c in columns]
    rows = list(zip(*(values[n] for n in names), strict=True))
    quoted = ", ".join(f'"{n}"' for n in names)
    if conn.dialect.name == "sqlite":
        placeholders = ", ".join("?" for _ in names)
        conn.exec_driver_sql(
            f'INSERT OR IGNORE INTO "{table.name}" ({quoted}) VALUES ({placeholders})', rows
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
            for row in rows:
                copy.write_row(row)
        cur.execute(
            f'INSERT INTO "{table.name}" ({quoted}) '
            f"SELECT {casts} FROM {stage} ON CONFLICT DO NOTHING"
        )


_MUTABLE_JOB_COLUMNS = (
    "name",
    "benchmark_key",
    "world_size",
    "device_name",
    "peak_flops",
    "ended_at",
    "attributes",
)

# Plain SQL that SQLite (>= 3.24) and PostgreSQL both accept; built once, executed per batch.
_CLAIM_BATCH = sa.text(
    "INSERT INTO ingest_batches (job_id, rank, incarnation, seq, received_at, num_steps, "
    "num_collectives, num_gpu, num_events) VALUES (:job_id, :rank, :incarnation, :seq, :now, "
    ":steps, :collectives, :gpu, :events) ON CONFLICT DO NOTHING RETURNING seq"
)
_STORED_COUNTS = sa.text(
    "SELECT num_steps, num_collectives, num_gpu, num_events FROM ingest_batches "
    "WHERE job_id = :job_id AND rank = :rank AND incarnation = :incarnation AND seq = :seq"
)
_UPSERT_JOB = sa.text(
    "INSERT INTO jobs (job_id, status, started_at, "
    + ", ".join(_MUTABLE_JOB_COLUMNS)
    + ") VALUES (:job_id, COALESCE(:status, 'running'), :started_at, "
    + ", ".join(f":{c}" for c in _MUTABLE_JOB_COLUMNS)
    + ") ON CONFLICT (job_id) DO UPDATE SET status = COALESCE(excluded.status, jobs.status), "
    + ", ".join(f"{c} = COALESCE(:{c}, jobs.{c})" for c in _MUTABLE_JOB_COLUMNS)
).bindparams(sa.bindparam("attributes", type_=sa.JSON(none_as_null=True)))
_UPSERT_RANK = sa.text(
    "INSERT INTO ranks (job_id, rank, local_rank, node, pid, incarnation, first_seen, last_seen) "
    "VALUES (:job_id, :rank, :local_rank, :node, :pid, :incarnation, :now, :now) "
    "ON CONFLICT (job_id, rank) DO UPDATE SET local_rank = excluded.local_rank, "
    "node = excluded.node, pid = excluded.pid, incarnation = excluded.incarnation, "
    "last_seen = excluded.last_seen"
)


class BatchWriter:
    """Writes validated wire batches; safe to call from many threads."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        # SQLite has one writer at a time: queue in-process instead of spinning on busy_timeout.
        self._write_lock: AbstractContextManager[Any] = (
            threading.Lock() if is_sqlite(engine) else nullcontext()
        )

    def write(
        self,
        *,
        job: dict[str, Any],
        source: dict[str, Any],
        seq: int,
        sections: dict[str, dict[str, list[Any]]],
    ) -> WriteResult:
        """Store a whole batch in one transaction, or nothing if its key was already stored."""
        counts = {
            name: len(sections[name]["rank"]) if name in sections else 0
            for name in tables.RECORD_TABLES
        }
        now = time.time()
        key = {
            "job_id": job["job_id"],
            "rank": source["rank"],
            "incarnation": source["incarnation"],
            "seq": seq,
        }
        started_at = min(sections["steps"]["ts"]) if "steps" in sections else None
        with self._write_lock, self.engine.begin() as conn:
            if conn.execute(_CLAIM_BATCH, {**key, **counts, "now": now}).first() is None:
                stored = conn.execute(_STORED_COUNTS, key).one()
                return WriteResult(accepted=dict(zip(counts, stored, strict=True)), duplicate=True)
            conn.execute(
                _UPSERT_JOB,
                {
                    "job_id": job["job_id"],
                    "status": job.get("status"),
                    "started_at": job.get("started_at") or started_at or now,
                    **{c: job.get(c) for c in _MUTABLE_JOB_COLUMNS},
                },
            )
            conn.execute(
                _UPSERT_RANK,
                {
                    "job_id": job["job_id"],
                    "rank": source["rank"],
                    "local_rank": source.get("local_rank"),
                    "node": source.get("node"),
                    "pid": source.get("pid"),
                    "incarnation": source["incarnation"],
                    "now": now,
                },
            )
            for name, values in sections.items():
                insert_ignoring_duplicates(conn, tables.RECORD_TABLES[name], values)
        return WriteResult(accepted=counts, duplicate=False)
