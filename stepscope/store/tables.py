"""Database tables. Record tables are generated from `stepscope.schema` (one definition)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stepscope import schema

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


_SQL_TYPES: dict[schema.Dtype, sa.types.TypeEngine[Any]] = {
    "str": sa.String(),
    "int": sa.BigInteger(),
    "float": sa.Float(precision=53),
    "json": sa.JSON(),
}

# Columns that live elsewhere in the store: a step's node is kept once per rank in `ranks`.
_NOT_STORED = {"steps": ("node",)}


def _record_table(spec: schema.Table, *, surrogate_id: bool = False) -> sa.Table:
    """A table with the columns, types, nullability and natural key of a schema table."""
    skipped = _NOT_STORED.get(spec.name, ())
    columns = [
        sa.Column(
            c.name,
            _SQL_TYPES[c.dtype],
            nullable=not c.required,
            primary_key=not surrogate_id and c.name in spec.key,
            comment=" ".join(filter(None, (c.doc, f"[{c.unit}]" if c.unit else ""))) or None,
        )
        for c in spec.columns
        if c.name not in skipped
    ]
    if surrogate_id:
        columns.insert(0, sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True))
    return sa.Table(spec.name, Base.metadata, *columns)


jobs = _record_table(schema.JOBS)
ranks = _record_table(schema.RANKS)
steps = _record_table(schema.STEPS)
collectives = _record_table(schema.COLLECTIVES)
gpu_samples = _record_table(schema.GPU)
events = _record_table(schema.EVENTS)
findings = _record_table(schema.FINDINGS, surrogate_id=True)
sa.Index("ix_findings_job_id", findings.c.job_id)

RECORD_TABLES: dict[str, sa.Table] = {
    "steps": steps,
    "collectives": collectives,
    "gpu": gpu_samples,
    "events": events,
}
"""Wire-batch section name → table."""


class IngestBatch(Base):
    """One accepted wire batch; its key makes a resend idempotent."""

    __tablename__ = "ingest_batches"

    job_id: Mapped[str] = mapped_column(sa.String(), primary_key=True)
    rank: Mapped[int] = mapped_column(sa.BigInteger(), primary_key=True)
    incarnation: Mapped[str] = mapped_column(sa.String(), primary_key=True)
    seq: Mapped[int] = mapped_column(sa.BigInteger(), primary_key=True)
    received_at: Mapped[float] = mapped_column(sa.Float(precision=53))
    num_steps: Mapped[int] = mapped_column(sa.Integer())
    num_collectives: Mapped[int] = mapped_column(sa.Integer())
    num_gpu: Mapped[int] = mapped_column(sa.Integer())
    num_events: Mapped[int] = mapped_column(sa.Integer())


class ApiToken(Base):
    """A bearer token; only its SHA-256 is stored."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(sa.Integer(), primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(sa.String())
    token_sha256: Mapped[str] = mapped_column(sa.String(64), unique=True)
    scopes: Mapped[str] = mapped_column(sa.String(), doc="space-separated scopes")
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
