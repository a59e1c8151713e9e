"""capture_requests and captures: deep captures of a culprit and a reference rank (#21)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _float(name: str, comment: str | None = None) -> sa.Column:
    return sa.Column(name, sa.Float(precision=53), nullable=True, comment=comment)


def upgrade() -> None:
    op.create_table(
        "capture_requests",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("reason", sa.String(), nullable=False, comment="the finding kind, or user"),
        sa.Column(
            "finding", sa.JSON(), nullable=True, comment="the finding that asked, as it was then"
        ),
        sa.Column("num_steps", sa.Integer(), nullable=False, comment="steps to record"),
        sa.Column("requested_at", sa.Float(precision=53), nullable=False, comment="[s]"),
        sa.Column("requested_by", sa.String(), nullable=False, comment="analysis or api"),
        sa.PrimaryKeyConstraint("id", name="pk_capture_requests"),
    )
    op.create_index("ix_capture_requests_job_id", "capture_requests", ["job_id"])
    op.create_table(
        "captures",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("request_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=False),
        sa.Column("role", sa.String(), nullable=False, comment="culprit or reference"),
        sa.Column("status", sa.String(), nullable=False, comment="one of CAPTURE_STATUSES"),
        _float("delivered_at", "told to the rank [s]"),
        _float("finished_at", "uploaded or failed [s]"),
        sa.Column("first_step", sa.BigInteger(), nullable=True),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.String(), nullable=True, comment="why the rank gave up"),
        sa.Column(
            "trace_bytes",
            sa.BigInteger(),
            nullable=True,
            comment="the gzipped trace's size [bytes]",
        ),
        sa.Column(
            "trace_gz",
            sa.LargeBinary(),
            nullable=True,
            comment="the Chrome/Perfetto JSON trace, gzipped",
        ),
        sa.Column("summary", sa.JSON(), nullable=True, comment="top operators and their time"),
        sa.PrimaryKeyConstraint("id", name="pk_captures"),
    )
    op.create_index("ix_captures_job_id", "captures", ["job_id"])
    op.create_index("ix_captures_request_id", "captures", ["request_id"])


def downgrade() -> None:
    op.drop_index("ix_captures_request_id", "captures")
    op.drop_index("ix_captures_job_id", "captures")
    op.drop_table("captures")
    op.drop_index("ix_capture_requests_job_id", "capture_requests")
    op.drop_table("capture_requests")
