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
# Columns optional on the wire and in files that the store keeps non-null, with this default
# where a batch or an older row has none: a collective's group is part of its key.
_STORED_DEFAULTS: dict[str, dict[str, str]] = {"collectives": {"group": schema.DEFAULT_GROUP}}


def _record_table(spec: schema.Table, *, surrogate_id: bool = False) -> sa.Table:
    """A table with the columns, types, nullability and natural key of a schema table."""
    skipped = _NOT_STORED.get(spec.name, ())
    defaults = _STORED_DEFAULTS.get(spec.name, {})
    columns = [
        sa.Column(
            c.name,
            _SQL_TYPES[c.dtype],
            nullable=not c.required and c.name not in defaults,
            server_default=defaults.get(c.name),
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
sa.Index("ix_gpu_samples_job_id_ts", gpu_samples.c.job_id, gpu_samples.c.ts)
"""Time-range reads of all ranks' samples (GPU rollups); the key leads with rank."""

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
    first_step: Mapped[int | None] = mapped_column(sa.BigInteger())
    """Smallest step among the batch's steps and collectives rows."""
    last_step: Mapped[int | None] = mapped_column(sa.BigInteger())
    first_gpu_ts: Mapped[float | None] = mapped_column(sa.Float(precision=53))
    last_gpu_ts: Mapped[float | None] = mapped_column(sa.Float(precision=53))


sa.Index("ix_ingest_batches_job_id_received_at", IngestBatch.job_id, IngestBatch.received_at)

job_columns = sa.Table(
    "job_columns",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("table_name", sa.String(), primary_key=True),
    sa.Column("column_name", sa.String(), primary_key=True),
)
"""The optional columns of a record table in which a job has stored a value, written with
the rows. Reads skip the others (null in every row of the job): a reader decodes a null at
about the cost of a value, and profilers leave whole columns empty (phases not marked)."""

OPTIONAL_COLUMNS: dict[str, tuple[str, ...]] = {
    name: tuple(c.name for c in table.columns if c.nullable)
    for name, table in RECORD_TABLES.items()
}
"""Wire-batch section name → the nullable columns of its table (those job_columns tracks)."""


class ApiToken(Base):
    """A bearer token; only its SHA-256 is stored."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(sa.Integer(), primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(sa.String())
    token_sha256: Mapped[str] = mapped_column(sa.String(64), unique=True)
    scopes: Mapped[str] = mapped_column(sa.String(), doc="space-separated scopes")
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))


# --- Rollups (DESIGN §6: the read path) ------------------------------------------------
# Maintained by the analyzer from raw rows; interactive queries read only these.

ROLLUP_METRICS = ("step_s", "data_s", "comm_wait_s", "compute_s")
"""Per-rank time components rolled up per step and per rank × step bucket."""
ROLLUP_AGGREGATES = ("min", "p50", "p90", "max", "mean")
GPU_SPREAD = ("util", "power_w", "temp_c", "sm_clock_mhz")
"""GPU metrics kept per bucket as min/p50/max over devices (stepscope.analysis.rollups)."""
"""Their statistics over ranks per step (stepscope.analysis.rollups.AGGREGATES)."""


def _floats(*names: str) -> list[sa.Column[Any]]:
    return [sa.Column(n, sa.Float(precision=53)) for n in names]


step_rollups = sa.Table(
    "step_rollups",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("step", sa.BigInteger(), primary_key=True),
    sa.Column("num_ranks", sa.Integer(), nullable=False),
    sa.Column("ts", sa.Float(precision=53)),
    *_floats(*(f"{m}_{q}" for m in ROLLUP_METRICS for q in ROLLUP_AGGREGATES)),
    sa.Column("slowest_rank", sa.BigInteger()),
    sa.Column("tokens", sa.BigInteger()),
    sa.Column("samples", sa.BigInteger()),
    sa.Column("flops", sa.Float(precision=53)),
    sa.Column("num_flops_ranks", sa.Integer()),
    sa.Column("mfu", sa.Float(precision=53)),
)

op_rollups = sa.Table(
    "op_rollups",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("step", sa.BigInteger(), primary_key=True),
    sa.Column("group", sa.String(), primary_key=True, server_default=""),
    sa.Column("op", sa.String(), primary_key=True),
    sa.Column("num_ranks", sa.Integer(), nullable=False),
    sa.Column("group_size", sa.Integer()),
    *_floats("count", "bytes", "busy_s_min", "busy_s_p50", "busy_s_max"),
    *_floats("busbw_min_bps", "busbw_p50_bps"),
)
"""Per step and process group label (schema.group_label: every tp group is "tp") and op."""

# One row per step bucket; per metric a float32 vector over the int32 vector `ranks`: a
# 1,024-rank heatmap reads 1,024 rows, not a million.
rank_buckets = sa.Table(
    "rank_buckets",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("first_step", sa.BigInteger(), primary_key=True),
    sa.Column("bucket_steps", sa.Integer(), nullable=False),
    sa.Column("ranks", sa.LargeBinary(), nullable=False),
    *(
        sa.Column(f"{m}_{a}", sa.LargeBinary(), nullable=False)
        for m in ROLLUP_METRICS
        for a in ("sum", "count", "max")
    ),
)

gpu_buckets = sa.Table(
    "gpu_buckets",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("first_ts", sa.Float(precision=53), primary_key=True),
    sa.Column("bucket_s", sa.Float(precision=53), nullable=False),
    # Arrow IPC of per-device stats (stepscope.analysis.rollups.gpu_buckets) of one bucket,
    # and their spread over devices (rollups.gpu_spread) for charts of the whole job.
    sa.Column("arrays", sa.LargeBinary(), nullable=False),
    sa.Column("num_devices", sa.Integer(), nullable=False),
    *_floats(*(f"{m}_{q}" for m in GPU_SPREAD for q in ("min", "p50", "max"))),
    sa.Column("throttle_reasons", sa.BigInteger()),
)

analysis_state = sa.Table(
    "analysis_state",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("watermark", sa.Float(precision=53), nullable=False),
    sa.Column("state", sa.JSON(), nullable=False),
    sa.Column("updated_at", sa.Float(precision=53), nullable=False),
)

job_summaries = sa.Table(
    "job_summaries",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("num_steps", sa.Integer(), nullable=False),
    sa.Column("first_step", sa.BigInteger()),
    sa.Column("last_step", sa.BigInteger()),
    *_floats(
        "step_p50_s",
        "step_p90_s",
        "tokens_per_s",
        "samples_per_s",
        "mfu",
        "data_share",
        "compute_share",
        "comm_wait_share",
    ),
    sa.Column(
        "goodput",
        sa.Float(precision=53),
        comment="productive share of the job's GPU-time (0-1), as of the last pass",
    ),
    *(sa.Column(f"num_{s}", sa.Integer(), nullable=False) for s in ("info", "warning", "critical")),
    sa.Column("updated_at", sa.Float(precision=53), nullable=False),
)
"""One row per analysed job: its steady-state figures and findings by severity, for lists."""
sa.Index("ix_job_summaries_step_p50_s", job_summaries.c.step_p50_s)

node_levels = sa.Table(
    "node_levels",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("node", sa.String(), primary_key=True),
    sa.Column("gpu", sa.String(), primary_key=True, comment="GPU UUID; '' on the node's row"),
    sa.Column("ranks", sa.String(), nullable=False, comment="schema.compact_ranks"),
    sa.Column("num_ranks", sa.Integer(), nullable=False),
    sa.Column("excess", sa.Float(precision=53), nullable=False, comment="log own time / median"),
    sa.Column("se", sa.Float(precision=53), comment="its standard error (log units)"),
    sa.Column("num_buckets", sa.Integer(), nullable=False),
    sa.Column("ts", sa.Float(precision=53), comment="the job's start [s]"),
    sa.Column("updated_at", sa.Float(precision=53), nullable=False),
)
"""Each node's and GPU's level in a job (stepscope.analysis.fleet.node_levels), what fleet health
reads (docs/fleet.md); rewritten by every pass that rolls up steps."""
sa.Index("ix_node_levels_gpu", node_levels.c.gpu, node_levels.c.updated_at)
"""Node rows (gpu "") by update: the fleet read's count and its rows written since."""
sa.Index("ix_node_levels_node", node_levels.c.node)

ROLLUP_TABLES = (
    step_rollups,
    op_rollups,
    rank_buckets,
    gpu_buckets,
    job_summaries,
    node_levels,
    analysis_state,
)

# --- Webhooks (DESIGN §6) ---------------------------------------------------------------

webhook_deliveries = sa.Table(
    "webhook_deliveries",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("finding_key", sa.String(64), primary_key=True, comment="sha256 of the finding"),
    sa.Column("target", sa.String(64), primary_key=True, comment="sha256 of the webhook URL"),
    sa.Column("payload", sa.JSON(), nullable=False),
    sa.Column("created_at", sa.Float(precision=53), nullable=False),
    sa.Column("attempts", sa.Integer(), nullable=False),
    sa.Column("next_attempt_at", sa.Float(precision=53), comment="NULL: delivered or given up"),
    sa.Column("delivered_at", sa.Float(precision=53)),
    sa.Column("last_error", sa.String()),
)
"""The webhook outbox: one row per (finding, URL), so each is delivered once, with retries."""
sa.Index("ix_webhook_deliveries_next_attempt_at", webhook_deliveries.c.next_attempt_at)

# --- Hang reports (#19) ------------------------------------------------------------------

hang_reports = sa.Table(
    "hang_reports",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("rank", sa.BigInteger(), primary_key=True),
    sa.Column("incarnation", sa.String()),
    sa.Column("node", sa.String()),
    sa.Column("pid", sa.BigInteger()),
    sa.Column("world_size", sa.BigInteger()),
    sa.Column("ts", sa.Float(precision=53), nullable=False, comment="when the rank made it [s]"),
    sa.Column("received_at", sa.Float(precision=53), nullable=False, comment="[s]"),
    sa.Column("kind", sa.String(), nullable=False, comment="heartbeat or hang"),
    sa.Column("step", sa.BigInteger()),
    sa.Column("section", sa.String()),
    sa.Column("phase", sa.String()),
    sa.Column("last_progress_ts", sa.Float(precision=53), comment="[s]"),
    sa.Column("stalled_s", sa.Float(precision=53), comment="[s]"),
    sa.Column("blocked", sa.JSON()),
    sa.Column("frontiers", sa.JSON()),
    sa.Column("stack", sa.JSON()),
    sa.Column("stack_source", sa.String()),
)
"""Each rank's latest hang report or heartbeat (POST /v1/hangs): one row per (job, rank)."""

# --- OTLP metrics (#25) ------------------------------------------------------------------

otlp_metrics = sa.Table(
    "otlp_metrics",
    Base.metadata,
    sa.Column("job_id", sa.String(), primary_key=True),
    sa.Column("rank", sa.BigInteger(), primary_key=True),
    sa.Column("name", sa.String(), primary_key=True, comment="the OTLP metric name"),
    sa.Column("series", sa.String(), primary_key=True, comment="its point attributes, as JSON"),
    sa.Column("ts", sa.Float(precision=53), primary_key=True, comment="[s]"),
    sa.Column("kind", sa.String(), nullable=False, comment="gauge, sum or histogram"),
    sa.Column("unit", sa.String()),
    sa.Column("value", sa.Float(precision=53), comment="a gauge's or sum's value; histogram sum"),
    sa.Column("count", sa.BigInteger(), comment="a histogram's count"),
    sa.Column("min", sa.Float(precision=53)),
    sa.Column("max", sa.Float(precision=53)),
    sa.Column("bounds", sa.JSON(), comment="a histogram's explicit bucket bounds"),
    sa.Column("bucket_counts", sa.JSON()),
)
"""OTLP points that are not GPU telemetry, placed in a job and rank (POST /v1/metrics)."""

# --- Deep captures (#21) -----------------------------------------------------------------

capture_requests = sa.Table(
    "capture_requests",
    Base.metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(), nullable=False),
    sa.Column("reason", sa.String(), nullable=False, comment="the finding kind, or user"),
    sa.Column("finding", sa.JSON(), comment="the finding that asked, as it was then"),
    sa.Column("num_steps", sa.Integer(), nullable=False, comment="steps to record"),
    sa.Column("requested_at", sa.Float(precision=53), nullable=False, comment="[s]"),
    sa.Column("requested_by", sa.String(), nullable=False, comment="analysis or api"),
)
"""One request for a deep capture: a culprit rank and a reference rank record torch.profiler."""
sa.Index("ix_capture_requests_job_id", capture_requests.c.job_id)

captures = sa.Table(
    "captures",
    Base.metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
    sa.Column("request_id", sa.Integer(), nullable=False),
    sa.Column("job_id", sa.String(), nullable=False),
    sa.Column("rank", sa.BigInteger(), nullable=False),
    sa.Column("role", sa.String(), nullable=False, comment="culprit or reference"),
    sa.Column("status", sa.String(), nullable=False, comment="one of CAPTURE_STATUSES"),
    sa.Column("delivered_at", sa.Float(precision=53), comment="told to the rank [s]"),
    sa.Column("finished_at", sa.Float(precision=53), comment="uploaded or failed [s]"),
    sa.Column("first_step", sa.BigInteger()),
    sa.Column("last_step", sa.BigInteger()),
    sa.Column("error", sa.String(), comment="why the rank gave up"),
    sa.Column("trace_bytes", sa.BigInteger(), comment="the gzipped trace's size [bytes]"),
    sa.Column("trace_gz", sa.LargeBinary(), comment="the Chrome/Perfetto JSON trace, gzipped"),
    sa.Column("summary", sa.JSON(), comment="top operators and their time"),
)
"""One rank's part of a capture request, with its trace once uploaded."""
sa.Index("ix_captures_job_id", captures.c.job_id)
sa.Index("ix_captures_request_id", captures.c.request_id)
