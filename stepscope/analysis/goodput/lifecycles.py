"""What a job's processes did, from their lifecycle events (docs/goodput.md): per rank and
process its start, first step, declared phases and exit; the exceptions that ended them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import polars as pl

from stepscope.schema import GoodputCategory

PHASE_CATEGORIES: dict[str, GoodputCategory] = {
    "checkpoint_save": "checkpoint_save",
    "checkpoint_load": "checkpoint_load",
    "eval": "eval",
    "compile": "compile",
    "fast_forward": "lost_progress",
    "startup": "startup",
}
"""Declared phase name → its category; any other name is other_phase."""


@dataclass(kw_only=True, slots=True)
class Lifecycles:
    """Per rank and process (incarnation) its lifecycle; declared phases; exceptions."""

    processes: pl.DataFrame
    """rank, index (0 for a rank's first process), incarnation, started_at, restart_count,
    submitted_at, first_step, first_step_ts, resumed_from, exit_ts, last_ts."""
    phases: pl.DataFrame
    """rank, ts, name, duration_s, category."""
    exceptions: pl.DataFrame
    """rank, ts, message, step (the step it interrupted, when the profiler knew it), index (of
    the rank's process it ended, when the event names its incarnation; else null)."""


_ATTRIBUTES = pl.Struct(
    {
        "incarnation": pl.String,
        "restart_count": pl.Int64,
        "submitted_at": pl.Float64,
        "step": pl.Int64,
        "resumed_from": pl.Int64,
        "name": pl.String,
        "duration_s": pl.Float64,
    }
)
"""The lifecycle attributes read (schema.LIFECYCLE_ATTRIBUTES; validated at ingest)."""
_PROCESS_SCHEMA = {
    "rank": pl.Int64,
    "incarnation": pl.String,
    "started_at": pl.Float64,
    "restart_count": pl.Int64,
    "submitted_at": pl.Float64,
    "first_step": pl.Int64,
    "first_step_ts": pl.Float64,
    "resumed_from": pl.Int64,
    "exit_ts": pl.Float64,
    "last_phase_end": pl.Float64,
    "index": pl.Int64,
    "last_ts": pl.Float64,
}


def lifecycles(events: pl.DataFrame) -> Lifecycles:
    """The lifecycles in a job's events (rank, ts, kind, message, attributes as JSON text)."""
    events = events.select(
        pl.col("rank").cast(pl.Int64),
        pl.col("ts").cast(pl.Float64),
        pl.col("kind").cast(pl.String),
        pl.col("message").cast(pl.String),
        pl.col("attributes").cast(pl.String).fill_null("{}"),
    )
    life = events.filter(pl.col("kind").is_in(["start", "resume", "phase", "exit"]))
    life = life.with_columns(pl.col("attributes").str.json_decode(_ATTRIBUTES).alias("a")).unnest(
        "a"
    )
    key = ["rank", "incarnation"]
    starts = (
        life.filter(pl.col("kind") == "start")
        .group_by(key)
        .agg(
            pl.col("ts").min().alias("started_at"),
            pl.col("restart_count").first(),
            pl.col("submitted_at").first(),
        )
    )
    resumes = (
        life.filter(pl.col("kind") == "resume")
        .sort("ts")
        .group_by(key)
        .agg(
            pl.col("ts").first().alias("first_step_ts"),
            pl.col("step").first().alias("first_step"),
            pl.col("resumed_from").drop_nulls().last(),
        )
    )
    exits = (
        life.filter(pl.col("kind") == "exit").group_by(key).agg(pl.col("ts").max().alias("exit_ts"))
    )
    phase_rows = life.filter(pl.col("kind") == "phase").select(
        "rank",
        "incarnation",
        "ts",
        pl.col("name").fill_null(""),
        pl.col("duration_s").fill_null(0.0),
    )
    phase_ends = phase_rows.group_by(key).agg(
        (pl.col("ts") + pl.col("duration_s")).max().alias("last_phase_end")
    )
    last_ts = (
        events.filter(pl.col("kind").is_in(["start", "resume", "phase", "exit", "exception"]))
        .group_by("rank")
        .agg(pl.col("ts").max().alias("last_ts"))
    )
    processes = (
        life.select(key)
        .unique()
        .join(starts, on=key, how="left", nulls_equal=True)
        .join(resumes, on=key, how="left", nulls_equal=True)
        .join(exits, on=key, how="left", nulls_equal=True)
        .join(phase_ends, on=key, how="left", nulls_equal=True)
        .join(last_ts, on="rank", how="left")
        .with_columns(
            # No start seen: the process began by its first record.
            pl.coalesce("started_at", "first_step_ts", "exit_ts").alias("started_at")
        )
        .filter(pl.col("started_at").is_not_null())
        .sort("rank", "started_at")
        .with_columns(pl.int_range(pl.len()).over("rank").cast(pl.Int64).alias("index"))
        .select(_PROCESS_SCHEMA.keys())
        .cast(_PROCESS_SCHEMA)  # type: ignore[arg-type]
    )
    phases = phase_rows.select(
        "rank",
        "ts",
        "name",
        "duration_s",
        pl.col("name")
        .replace_strict(PHASE_CATEGORIES, default="other_phase", return_dtype=pl.String)
        .alias("category"),
    )
    exceptions = events.filter(pl.col("kind") == "exception").select(
        "rank",
        "ts",
        "message",
        pl.col("attributes")
        .str.json_path_match("$.step")
        .cast(pl.Int64, strict=False)
        .alias("step"),
        pl.col("attributes").str.json_path_match("$.incarnation").alias("incarnation"),
    )
    exceptions = exceptions.join(
        processes.select("rank", "incarnation", "index"),
        on=["rank", "incarnation"],
        how="left",
    ).drop("incarnation")
    return Lifecycles(processes=processes, phases=phases, exceptions=exceptions)


def without_lifecycle(steps: pl.DataFrame, world_size: int) -> Lifecycles:
    """Lifecycles for a job whose profilers sent none: one process per rank, starting at the
    first step (restarts are not seen)."""
    first_ts = float(steps["ts"].min()) if steps.height else math.nan  # type: ignore[arg-type]
    first_step = int(steps["step"].min()) if steps.height else None  # type: ignore[arg-type]
    processes = pl.DataFrame(
        {
            "rank": list(range(world_size)),
            "incarnation": [""] * world_size,
            "started_at": [first_ts] * world_size,
            "restart_count": [None] * world_size,
            "submitted_at": [None] * world_size,
            "first_step": [first_step] * world_size,
            "first_step_ts": [first_ts] * world_size,
            "resumed_from": [None] * world_size,
            "exit_ts": [None] * world_size,
            "last_phase_end": [None] * world_size,
            "index": [0] * world_size,
            "last_ts": [None] * world_size,
        },
        schema_overrides={
            "restart_count": pl.Int64,
            "submitted_at": pl.Float64,
            "first_step": pl.Int64,
            "resumed_from": pl.Int64,
            "exit_ts": pl.Float64,
            "last_phase_end": pl.Float64,
            "index": pl.Int64,
            "last_ts": pl.Float64,
        },
    )
    empty = lifecycles(
        pl.DataFrame(
            schema={
                "rank": pl.Int64,
                "ts": pl.Float64,
                "kind": pl.String,
                "message": pl.String,
                "attributes": pl.String,
            }
        )
    )
    return Lifecycles(processes=processes, phases=empty.phases, exceptions=empty.exceptions)
