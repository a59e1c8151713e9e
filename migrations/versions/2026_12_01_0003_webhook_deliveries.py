"""webhook deliveries (the outbox of finding notifications)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "webhook_deliveries",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("finding_key", sa.String(64), nullable=False, comment="sha256 of the finding"),
        sa.Column("target", sa.String(64), nullable=False, comment="sha256 of the webhook URL"),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(precision=53), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column(
            "next_attempt_at",
            sa.Float(precision=53),
            nullable=True,
            comment="NULL: delivered or given up",
        ),
        sa.Column("delivered_at", sa.Float(precision=53), nullable=True),
        sa.Column("last_error", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint(
            "job_id", "finding_key", "target", name=op.f("pk_webhook_deliveries")
        ),
    )
    op.create_index(
        "ix_webhook_deliveries_next_attempt_at", "webhook_deliveries", ["next_attempt_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_next_attempt_at", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
