"""job_columns: the optional record columns in which each job has stored a value

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 18:30:00

Jobs stored before this revision are marked as having a value in every optional column, so
their reads stay whole: they read every column, as before.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RECORD_TABLES = ("steps", "collectives", "gpu_samples", "events")


def upgrade() -> None:
    job_columns = op.create_table(
        "job_columns",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("table_name", sa.String(), nullable=False),
        sa.Column("column_name", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "table_name", "column_name", name=op.f("pk_job_columns")),
    )
    conn = op.get_bind()
    inspector = sa.inspect(conn)
    optional = {
        table: [c["name"] for c in inspector.get_columns(table) if c["nullable"]]
        for table in RECORD_TABLES
    }
    jobs = conn.execute(sa.text("SELECT job_id FROM jobs")).scalars().all()
    rows = [
        {"job_id": job_id, "table_name": table, "column_name": column}
        for job_id in jobs
        for table, columns in optional.items()
        for column in columns
    ]
    if rows:
        op.bulk_insert(job_columns, rows)


def downgrade() -> None:
    op.drop_table("job_columns")
