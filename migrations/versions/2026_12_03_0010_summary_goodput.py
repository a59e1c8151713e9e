"""job_summaries.goodput: each pass stores the job's goodput for lists and /metrics (#25)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 22:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_summaries") as batch:
        batch.add_column(
            sa.Column(
                "goodput",
                sa.Float(precision=53),
                nullable=True,
                comment="productive share of the job's GPU-time (0-1), as of the last pass",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("job_summaries") as batch:
        batch.drop_column("goodput")
