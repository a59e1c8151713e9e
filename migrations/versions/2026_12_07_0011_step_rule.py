"""steps.step_rule: what marked a step when the user's code did not (zero-code, adapters; #51)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(
            sa.Column(
                "step_rule",
                sa.String(),
                nullable=True,
                comment="what marked the step (STEP_RULES); null: the user's step()",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("step_rule")
