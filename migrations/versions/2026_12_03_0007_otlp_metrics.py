"""otlp_metrics: OTLP points other than GPU telemetry, per job and rank; ranks.attributes (#25)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _float(name: str, comment: str | None = None) -> sa.Column:
    return sa.Column(name, sa.Float(precision=53), nullable=True, comment=comment)


def upgrade() -> None:
    op.create_table(
        "otlp_metrics",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(), nullable=False, comment="the OTLP metric name"),
        sa.Column("series", sa.String(), nullable=False, comment="its point attributes, as JSON"),
        sa.Column("ts", sa.Float(precision=53), nullable=False, comment="[s]"),
        sa.Column("kind", sa.String(), nullable=False, comment="gauge, sum or histogram"),
        sa.Column("unit", sa.String(), nullable=True),
        _float("value", "a gauge's or sum's value; histogram sum"),
        sa.Column("count", sa.BigInteger(), nullable=True, comment="a histogram's count"),
        _float("min"),
        _float("max"),
        sa.Column(
            "bounds", sa.JSON(), nullable=True, comment="a histogram's explicit bucket bounds"
        ),
        sa.Column("bucket_counts", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("job_id", "rank", "name", "series", "ts", name="pk_otlp_metrics"),
    )
    with op.batch_alter_table("ranks") as batch:
        batch.add_column(
            sa.Column(
                "attributes",
                sa.JSON(),
                nullable=True,
                comment="where the rank ran: scheduler names (k8s.pod.name, slurm...), gpu.uuid",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("ranks") as batch:
        batch.drop_column("attributes")
    op.drop_table("otlp_metrics")
