"""collectives per process group (#18): group in the key, wait_s, first_seq, mesh_dim and
group_ranks; ranks.mesh; op_rollups per group label

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 09:00:00

Rows stored before this revision keep their values with group '' (schema.DEFAULT_GROUP:
the process group is not known) and nulls in the new columns. SQLite cannot alter a
primary key: its tables are rebuilt (batch mode), rows and all.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _group(comment: str | None = None) -> sa.Column:
    return sa.Column("group", sa.String(), nullable=False, server_default="", comment=comment)


def upgrade() -> None:
    with op.batch_alter_table("collectives") as batch:
        batch.add_column(_group("process group name (pg.group_name; the same on every member)"))
        batch.add_column(
            sa.Column(
                "wait_s",
                sa.Float(precision=53),
                nullable=True,
                comment="time the training thread sat blocked on these calls [s]",
            )
        )
        batch.add_column(
            sa.Column(
                "first_seq",
                sa.BigInteger(),
                nullable=True,
                comment="per-group sequence number of the step's first call of op",
            )
        )
        batch.add_column(
            sa.Column(
                "mesh_dim",
                sa.String(),
                nullable=True,
                comment="DeviceMesh dimension the group spans (tp, dp_shard, pp, ...)",
            )
        )
        batch.add_column(
            sa.Column(
                "group_ranks",
                sa.String(),
                nullable=True,
                comment="members, compact: 0-3, 0-6:2, 0,1,5 or h:<hash>",
            )
        )
        batch.drop_constraint("pk_collectives", type_="primary")
        batch.create_primary_key("pk_collectives", ["job_id", "rank", "step", "group", "op"])
    with op.batch_alter_table("ranks") as batch:
        batch.add_column(
            sa.Column(
                "mesh",
                sa.JSON(),
                nullable=True,
                comment="DeviceMesh coordinates: {dim: [coordinate, size]} (pp: stage)",
            )
        )
    with op.batch_alter_table("op_rollups") as batch:
        batch.add_column(_group())
        batch.drop_constraint("pk_op_rollups", type_="primary")
        batch.create_primary_key("pk_op_rollups", ["job_id", "step", "group", "op"])


def _same_key(table: str, key: Sequence[str]) -> str:
    return " AND ".join(f'"other"."{c}" = "{table}"."{c}"' for c in key)


def _merge_groups(
    table: str, key: Sequence[str], sums: Sequence[str], maxima: Sequence[str]
) -> None:
    """Fold the rows of one (key) in several groups into the row of its smallest group name."""
    same = _same_key(table, key)
    first = f'NOT EXISTS (SELECT 1 FROM "{table}" AS "other" WHERE {same} AND "other"."group" < "{table}"."group")'
    merged = ", ".join(
        f'"{c}" = (SELECT {agg}("other"."{c}") FROM "{table}" AS "other" WHERE {same})'
        for agg, columns in (("SUM", sums), ("MAX", maxima))
        for c in columns
    )
    if merged:
        op.execute(f'UPDATE "{table}" SET {merged} WHERE {first}')
    op.execute(f'DELETE FROM "{table}" WHERE NOT ({first})')


def downgrade() -> None:
    # The old key holds one row per (step, op): a rank's rows in several groups are summed
    # into one, as profilers before #18 recorded them. Rollups keep their smallest group's
    # row (the next full pass recomputes them).
    _merge_groups(
        "collectives",
        ("job_id", "rank", "step", "op"),
        sums=("count", "bytes", "busy_s"),
        maxima=("group_size",),
    )
    _merge_groups("op_rollups", ("job_id", "step", "op"), sums=(), maxima=())
    with op.batch_alter_table("op_rollups") as batch:
        batch.drop_constraint("pk_op_rollups", type_="primary")
        batch.create_primary_key("pk_op_rollups", ["job_id", "step", "op"])
        batch.drop_column("group")
    with op.batch_alter_table("ranks") as batch:
        batch.drop_column("mesh")
    with op.batch_alter_table("collectives") as batch:
        batch.drop_constraint("pk_collectives", type_="primary")
        batch.create_primary_key("pk_collectives", ["job_id", "rank", "step", "op"])
        for column in ("group_ranks", "mesh_dim", "first_seq", "wait_s", "group"):
            batch.drop_column(column)
    op.execute(
        "DELETE FROM job_columns WHERE table_name = 'collectives' "
        "AND column_name IN ('wait_s', 'first_seq', 'mesh_dim', 'group_ranks')"
    )
