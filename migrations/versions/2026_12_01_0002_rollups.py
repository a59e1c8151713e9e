"""rollups and incremental analysis state

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 10:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

METRICS = ("step_s", "data_s", "comm_wait_s", "compute_s")


def _float(name: str) -> sa.Column:
    return sa.Column(name, sa.Float(precision=53), nullable=True)


def upgrade() -> None:
    with op.batch_alter_table("ingest_batches") as batch:
        batch.add_column(sa.Column("first_step", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("last_step", sa.BigInteger(), nullable=True))
        batch.add_column(_float("first_gpu_ts"))
        batch.add_column(_float("last_gpu_ts"))
    op.create_index(
        "ix_ingest_batches_job_id_received_at", "ingest_batches", ["job_id", "received_at"]
    )
    op.create_index("ix_gpu_samples_job_id_ts", "gpu_samples", ["job_id", "ts"])
    op.create_table(
        "step_rollups",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("num_ranks", sa.Integer(), nullable=False),
        _float("ts"),
        *(_float(f"{m}_{q}") for m in METRICS for q in ("min", "p50", "p90", "max", "mean")),
        sa.Column("slowest_rank", sa.BigInteger(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=True),
        sa.Column("samples", sa.BigInteger(), nullable=True),
        _float("flops"),
        sa.Column("num_flops_ranks", sa.Integer(), nullable=True),
        _float("mfu"),
        sa.PrimaryKeyConstraint("job_id", "step", name=op.f("pk_step_rollups")),
    )
    op.create_table(
        "op_rollups",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("op", sa.String(), nullable=False),
        sa.Column("num_ranks", sa.Integer(), nullable=False),
        sa.Column("group_size", sa.Integer(), nullable=True),
        *(
            _float(n)
            for n in (
                "count",
                "bytes",
                "busy_s_min",
                "busy_s_p50",
                "busy_s_max",
                "busbw_min_bps",
                "busbw_p50_bps",
            )
        ),
        sa.PrimaryKeyConstraint("job_id", "step", "op", name=op.f("pk_op_rollups")),
    )
    op.create_table(
        "rank_buckets",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("bucket_steps", sa.Integer(), nullable=False),
        sa.Column("ranks", sa.LargeBinary(), nullable=False),
        *(
            sa.Column(f"{m}_{a}", sa.LargeBinary(), nullable=False)
            for m in METRICS
            for a in ("sum", "count", "max")
        ),
        sa.PrimaryKeyConstraint("job_id", "first_step", name=op.f("pk_rank_buckets")),
    )
    op.create_table(
        "gpu_buckets",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("first_ts", sa.Float(precision=53), nullable=False),
        sa.Column("bucket_s", sa.Float(precision=53), nullable=False),
        sa.Column("arrays", sa.LargeBinary(), nullable=False),
        sa.Column("num_devices", sa.Integer(), nullable=False),
        *(
            _float(f"{m}_{q}")
            for m in ("util", "power_w", "temp_c", "sm_clock_mhz")
            for q in ("min", "p50", "max")
        ),
        sa.Column("throttle_reasons", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("job_id", "first_ts", name=op.f("pk_gpu_buckets")),
    )
    op.create_table(
        "job_summaries",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("num_steps", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=True),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        *(
            _float(n)
            for n in (
                "step_p50_s",
                "step_p90_s",
                "tokens_per_s",
                "samples_per_s",
                "mfu",
                "data_share",
                "compute_share",
                "comm_wait_share",
            )
        ),
        *(
            sa.Column(f"num_{s}", sa.Integer(), nullable=False)
            for s in ("info", "warning", "critical")
        ),
        sa.Column("updated_at", sa.Float(precision=53), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_job_summaries")),
    )
    op.create_index("ix_job_summaries_step_p50_s", "job_summaries", ["step_p50_s"])
    op.create_table(
        "analysis_state",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("watermark", sa.Float(precision=53), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Float(precision=53), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_analysis_state")),
    )


def downgrade() -> None:
    op.drop_index("ix_job_summaries_step_p50_s", table_name="job_summaries")
    for table in (
        "analysis_state",
        "job_summaries",
        "gpu_buckets",
        "rank_buckets",
        "op_rollups",
        "step_rollups",
    ):
        op.drop_table(table)
    op.drop_index("ix_gpu_samples_job_id_ts", table_name="gpu_samples")
    op.drop_index("ix_ingest_batches_job_id_received_at", table_name="ingest_batches")
    with op.batch_alter_table("ingest_batches") as batch:
        for column in ("last_gpu_ts", "first_gpu_ts", "last_step", "first_step"):
            batch.drop_column(column)
