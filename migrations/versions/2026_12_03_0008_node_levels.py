"""node_levels: each node's and GPU's level in a job, for fleet health (#21)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "node_levels",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("node", sa.String(), nullable=False),
        sa.Column("gpu", sa.String(), nullable=False, comment="GPU UUID; '' on the node's row"),
        sa.Column("ranks", sa.String(), nullable=False, comment="schema.compact_ranks"),
        sa.Column("num_ranks", sa.Integer(), nullable=False),
        sa.Column(
            "excess", sa.Float(precision=53), nullable=False, comment="log own time / median"
        ),
        sa.Column(
            "se", sa.Float(precision=53), nullable=True, comment="its standard error (log units)"
        ),
        sa.Column("num_buckets", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(precision=53), nullable=True, comment="the job's start [s]"),
        sa.Column("updated_at", sa.Float(precision=53), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "node", "gpu", name="pk_node_levels"),
    )
    op.create_index("ix_node_levels_gpu", "node_levels", ["gpu", "updated_at"])
    op.create_index("ix_node_levels_node", "node_levels", ["node"])


def downgrade() -> None:
    op.drop_index("ix_node_levels_node", table_name="node_levels")
    op.drop_index("ix_node_levels_gpu", table_name="node_levels")
    op.drop_table("node_levels")
