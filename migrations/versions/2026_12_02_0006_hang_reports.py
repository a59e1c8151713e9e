"""hang_reports: each rank's latest hang report or heartbeat (#19)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _float(name: str, comment: str | None = None, *, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.Float(precision=53), nullable=nullable, comment=comment)


def upgrade() -> None:
    op.create_table(
        "hang_reports",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=False),
        sa.Column("incarnation", sa.String(), nullable=True),
        sa.Column("node", sa.String(), nullable=True),
        sa.Column("pid", sa.BigInteger(), nullable=True),
        sa.Column("world_size", sa.BigInteger(), nullable=True),
        _float("ts", "when the rank made it [s]", nullable=False),
        _float("received_at", "[s]", nullable=False),
        sa.Column("kind", sa.String(), nullable=False, comment="heartbeat or hang"),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("section", sa.String(), nullable=True),
        sa.Column("phase", sa.String(), nullable=True),
        _float("last_progress_ts", "[s]"),
        _float("stalled_s", "[s]"),
        sa.Column("blocked", sa.JSON(), nullable=True),
        sa.Column("frontiers", sa.JSON(), nullable=True),
        sa.Column("stack", sa.JSON(), nullable=True),
        sa.Column("stack_source", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("job_id", "rank", name="pk_hang_reports"),
    )


def downgrade() -> None:
    op.drop_table("hang_reports")
