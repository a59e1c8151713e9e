"""Alembic migrations on empty SQLite and PostgreSQL databases."""

from __future__ import annotations

import subprocess
import sys

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from stepscope import schema
from stepscope.store import frames, tables
from stepscope.store.engine import make_engine
from stepscope.store.frames import read_frame
from stepscope.store.migrate import current_revision, downgrade, head_revision, upgrade

EXPECTED_TABLES = {
    "node_levels",
    "jobs",
    "capture_requests",
    "captures",
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
    "hang_reports",
    "analysis_state",
    "webhook_deliveries",
    "job_columns",
    "otlp_metrics",
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
        "group",
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
    # Every column the job could fill then counts as filled; step_rule (0011) came later.
    assert frames._unfilled_columns(engine, "steps", "old") == {"step_rule"}
    engine.dispose()


def test_the_migrated_schema_is_the_tables_module(db_url: str) -> None:
    engine = make_engine(db_url)
    inspector = sa.inspect(engine)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), tables.Base.metadata) == []
    # Alembic's comparison leaves out primary keys and server defaults.
    for table in tables.Base.metadata.sorted_tables:
        stored = inspector.get_pk_constraint(table.name)
        assert stored["constrained_columns"] == [c.name for c in table.primary_key.columns]
        assert stored["name"] == f"pk_{table.name}"
    for name in ("collectives", "op_rollups"):
        (group,) = [c for c in inspector.get_columns(name) if c["name"] == "group"]
        assert not group["nullable"]
        assert group["default"] in ("''", "''::character varying")
    engine.dispose()


def _insert(engine: sa.Engine, table: str, **row: object) -> None:
    names = ", ".join(f'"{n}"' for n in row)
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {table} ({names}) VALUES (:{', :'.join(row)})"), row)


def _rows(engine: sa.Engine, sql: str) -> list[tuple[object, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(sql))]


def test_collective_groups_migration_keeps_old_rows_and_downgrades(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    upgrade(engine, "0004")
    _insert(engine, "jobs", job_id="old", status="finished", started_at=1.0)
    _insert(engine, "ranks", job_id="old", rank=0, node="n0")
    old = {"job_id": "old", "rank": 0, "op": "all_reduce", "group_size": 2, "count": 3}
    for step in (0, 1):
        _insert(engine, "collectives", **old, step=step, bytes=400, busy_s=0.25 + step)
    _insert(engine, "op_rollups", job_id="old", step=0, op="all_reduce", num_ranks=2, count=3.0)

    upgrade(engine, "0005")

    collectives = read_frame(engine, "collectives", "old")
    assert collectives.columns == list(schema.COLLECTIVES.names)
    assert collectives.select("step", "group", "op", "busy_s", "wait_s", "first_seq").rows() == [
        (0, "", "all_reduce", 0.25, None, None),
        (1, "", "all_reduce", 1.25, None, None),
    ]
    assert collectives.select("mesh_dim", "group_ranks").null_count().row(0) == (2, 2)
    assert read_frame(engine, "ranks", "old", columns=["rank", "node", "mesh"]).rows() == [
        (0, "n0", None)
    ]
    assert _rows(engine, 'SELECT step, "group", op, count FROM op_rollups') == [
        (0, "", "all_reduce", 3.0)
    ]
    # Step 0's all_reduce in group "1" is a row of its own now.
    _insert(engine, "collectives", **old, step=0, group="1", bytes=100, busy_s=0.5, wait_s=0.1)
    assert len(read_frame(engine, "collectives", "old")) == 3

    downgrade(engine, "0004")

    # The old key holds one row per (step, op): the groups' rows are summed into it.
    assert _rows(
        engine, "SELECT step, op, group_size, count, bytes, busy_s FROM collectives ORDER BY step"
    ) == [(0, "all_reduce", 2, 6, 500, 0.75), (1, "all_reduce", 2, 3, 400, 1.25)]
    names = {c["name"] for c in sa.inspect(engine).get_columns("collectives")}
    assert names == {"job_id", "rank", "step", "op", "group_size", "count", "bytes", "busy_s"}
    assert "mesh" not in {c["name"] for c in sa.inspect(engine).get_columns("ranks")}
    assert _rows(engine, "SELECT step, op FROM op_rollups") == [(0, "all_reduce")]

    upgrade(engine)
    assert read_frame(engine, "collectives", "old", columns=["step", "group"]).rows() == [
        (0, ""),
        (1, ""),
    ]
    engine.dispose()


def test_hang_reports_migration_creates_and_drops_its_table(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    upgrade(engine, "0006")
    inspector = sa.inspect(engine)
    assert inspector.get_pk_constraint("hang_reports")["constrained_columns"] == ["job_id", "rank"]
    _insert(engine, "hang_reports", job_id="j", rank=3, ts=1.0, received_at=2.0, kind="hang")
    assert _rows(engine, "SELECT job_id, rank, kind FROM hang_reports") == [("j", 3, "hang")]
    downgrade(engine, "0005")
    assert "hang_reports" not in sa.inspect(engine).get_table_names()
    engine.dispose()


def test_otlp_migration_adds_its_table_and_rank_attributes_and_takes_them_back(
    empty_db_url: str,
) -> None:
    engine = make_engine(empty_db_url)
    upgrade(engine, "0007")
    inspector = sa.inspect(engine)
    assert inspector.get_pk_constraint("otlp_metrics")["constrained_columns"] == [
        "job_id",
        "rank",
        "name",
        "series",
        "ts",
    ]
    assert "attributes" in {c["name"] for c in inspector.get_columns("ranks")}
    _insert(engine, "otlp_metrics", job_id="j", rank=1, name="m", series="{}", ts=1.0, kind="gauge")
    _insert(engine, "ranks", job_id="j", rank=1, node="n", first_seen=1.0, last_seen=1.0)
    downgrade(engine, "0006")
    assert "otlp_metrics" not in sa.inspect(engine).get_table_names()
    assert "attributes" not in {c["name"] for c in sa.inspect(engine).get_columns("ranks")}
    assert _rows(engine, "SELECT job_id, rank, node FROM ranks") == [("j", 1, "n")]
    engine.dispose()
