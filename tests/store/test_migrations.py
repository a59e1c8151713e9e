"""Alembic migrations on empty SQLite and PostgreSQL databases."""

from __future__ import annotations

import subprocess
import sys

import sqlalchemy as sa

from stepscope.store import frames
from stepscope.store.engine import make_engine
from stepscope.store.frames import read_frame
from stepscope.store.migrate import current_revision, head_revision, upgrade

EXPECTED_TABLES = {
    "jobs",
    "ranks",
    "steps",
    "collectives",
    "gpu_samples",
    "events",
    "findings",
    "ingest_batches",
    "api_tokens",
    "step_rollups",
    "op_rollups",
    "rank_buckets",
    "gpu_buckets",
    "job_summaries",
    "analysis_state",
    "webhook_deliveries",
    "job_columns",
    "alembic_version",
}


def test_db_upgrade_creates_every_table_on_an_empty_database(empty_db_url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "db", "upgrade", "--db", empty_db_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    engine = make_engine(empty_db_url)
    inspector = sa.inspect(engine)
    assert set(inspector.get_table_names()) == EXPECTED_TABLES
    assert current_revision(engine) == head_revision()
    steps_pk = inspector.get_pk_constraint("steps")["constrained_columns"]
    assert steps_pk == ["job_id", "rank", "step"]
    assert inspector.get_pk_constraint("collectives")["constrained_columns"] == [
        "job_id",
        "rank",
        "step",
        "op",
    ]
    nullable = {c["name"]: c["nullable"] for c in inspector.get_columns("steps")}
    assert nullable["step_s"] is False
    assert nullable["comm_wait_s"] is True
    engine.dispose()


def test_server_refuses_an_unmigrated_postgres_database(empty_db_url: str) -> None:
    if empty_db_url.startswith("sqlite"):
        # The embedded default migrates itself at start.
        from tests.live_server import run_server

        with run_server(empty_db_url):
            assert current_revision(make_engine(empty_db_url)) == head_revision()
        return
    out = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "serve", "--port", "0", "--db", empty_db_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "stepscope db upgrade" in out.stderr
    assert "Traceback" not in out.stderr


def test_jobs_stored_before_job_columns_keep_every_column_on_read(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    upgrade(engine, "0003")
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO jobs (job_id, status, started_at) VALUES ('old', 'running', 1.0)")
        )
        conn.execute(sa.text("INSERT INTO ranks (job_id, rank, node) VALUES ('old', 0, 'n0')"))
        conn.execute(
            sa.text(
                "INSERT INTO steps (job_id, rank, step, ts, step_s, data_s, forward_s) "
                "VALUES ('old', 0, 0, 1.0, 0.5, 0.1, 0.25)"
            )
        )

    upgrade(engine)

    assert read_frame(engine, "steps", "old", columns=["step", "forward_s"]).rows() == [(0, 0.25)]
    assert not frames._unfilled_columns(engine, "steps", "old")
    engine.dispose()
