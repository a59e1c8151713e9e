"""What the pages show, read through stepscope.query in-process (no SQL, no statistics).

Each function gathers the query results one page or one callback needs; a page's reads
run concurrently (they are independent, and the database drivers release the GIL).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa

from stepscope import query
from stepscope.analysis import rollups
from stepscope.figures import Event
from stepscope.query.goodput import JobGoodput, job_goodput
from stepscope.query.jobs import MAX_LIMIT

MAX_POINTS = 2000
"""Points of a step series; more than a chart is wide, a spike stays (MinMaxLTTB)."""
GPU_POINTS = rollups.MAX_BUCKETS
"""Time buckets of GPU telemetry: all the rollup holds (fewer re-buckets every device)."""
HEATMAP_CELLS = 200_000
"""Cells of a rank × step heatmap: ~0.3 MB on the wire (figures.round_mantissa); at 1,024
ranks ~190 columns, enough to show when a rank or node slowed (a zoom re-reads finer)."""
HEATMAP_MAX_RANKS = 1024
"""Up to this many ranks, every rank has its own heatmap row."""
HEATMAP_STEPS = (100, 800)
"""Bounds of the heatmap's columns."""
MAX_EVENTS = 500

T = TypeVar("T")
_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="stepscope-dashboard")


def _gather(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run independent reads concurrently; the first error is raised."""
    futures = {name: _pool.submit(call) for name, call in calls.items()}
    return {name: future.result() for name, future in futures.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class JobPage:
    """Everything the job page draws."""

    summary: query.JobSummary
    band: query.Band
    tokens: query.Series
    mfu: query.Series
    heatmap: query.Heatmap | None
    ranks: query.RankTable
    mesh: query.Mesh
    """What the heatmap and the breakdown can group ranks by (mesh.group_by)."""
    findings: list[query.StoredFinding]
    collectives: query.CollectiveStats
    gpu: query.GpuSeries | None
    events: list[Event]
    goodput: JobGoodput | None
    """Read for the page's first draw only (the live refresh leaves the goodput alone)."""


def job_page(engine: sa.Engine, job_id: str, *, with_goodput: bool = True) -> JobPage:
    """The job page's data; raises query.JobNotFound for an unknown job."""
    summary = query.job_summary(engine, job_id)
    got = _gather(
        {
            "band": lambda: query.step_band(engine, job_id, max_points=MAX_POINTS),
            "tokens": lambda: query.step_series(
                engine, job_id, "tokens_per_s", max_points=MAX_POINTS
            ),
            "mfu": lambda: query.step_series(engine, job_id, "mfu", max_points=MAX_POINTS),
            "heatmap": lambda: heatmap(engine, job_id, summary.world_size),
            "ranks": lambda: query.rank_table(engine, job_id),
            "mesh": lambda: query.job_mesh(engine, job_id),
            "findings": lambda: query.findings(engine, job_id),
            "collectives": lambda: query.collective_stats(engine, job_id, max_points=MAX_POINTS),
            "gpu": lambda: query.gpu_series(engine, job_id, max_points=GPU_POINTS),
            "events": lambda: events(engine, job_id, summary),
            "goodput": lambda: job_goodput(engine, job_id) if with_goodput else None,
        }
    )
    return JobPage(summary=summary, **got)


def heatmap_shape(world_size: int | None) -> tuple[int, int]:
    """(max_ranks, max_steps) of a heatmap within HEATMAP_CELLS."""
    rows = min(max(world_size or 1, 1), HEATMAP_MAX_RANKS)
    lo, hi = HEATMAP_STEPS
    return rows, int(min(max(HEATMAP_CELLS // rows, lo), hi))


def heatmap(
    engine: sa.Engine,
    job_id: str,
    world_size: int | None,
    *,
    metric: str = "compute_s",
    stat: str = "mean",
    group_by: str = "rank",
    from_step: int | None = None,
    to_step: int | None = None,
) -> query.Heatmap | None:
    """The rank × step heatmap at the dashboard's resolution (a zoom reads a step range)."""
    max_ranks, max_steps = heatmap_shape(world_size)
    return query.heatmap(
        engine,
        job_id,
        metric,
        stat=stat,
        group_by=group_by,
        max_ranks=max_ranks,
        max_steps=max_steps,
        from_step=from_step,
        to_step=to_step,
    )


def breakdown(engine: sa.Engine, job_id: str, group_by: str) -> query.RankTable | query.RankGroups:
    """The per-rank breakdown's table: every rank, or the groups of `group_by`."""
    if group_by == "rank":
        return query.rank_table(engine, job_id)
    return query.rank_groups(engine, job_id, group_by)


def events(engine: sa.Engine, job_id: str, summary: query.JobSummary) -> list[Event]:
    """The job's events on the step axis (from attributes.step, else placed by time between
    the job's first and last step), at most MAX_EVENTS."""
    out = []
    for row in query.events(engine, job_id, limit=MAX_EVENTS):
        step = _event_step(row, summary)
        if step is not None:
            out.append(Event(step=step, kind=row["kind"], rank=row["rank"], message=row["message"]))
    return out


def _event_step(row: dict[str, Any], s: query.JobSummary) -> float | None:
    attributes = row.get("attributes")
    step = attributes.get("step") if isinstance(attributes, dict) else None
    if isinstance(step, int | float) and not isinstance(step, bool):
        return float(step)
    first, last, t0, t1 = s.first_step, s.last_step, s.started_at, s.last_seen
    if first is None or last is None or t0 is None or t1 is None:
        return None
    if t1 <= t0:
        return float(first)
    at = min(max((row["ts"] - t0) / (t1 - t0), 0.0), 1.0)
    return first + at * (last - first)


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveUpdate:
    """What arrived after a step: new band, rate and heatmap columns; current summary."""

    summary: query.JobSummary
    band: query.Band
    tokens: query.Series
    mfu: query.Series
    heatmap: query.Heatmap | None
    findings: list[query.StoredFinding]


def live_update(
    engine: sa.Engine,
    job_id: str,
    *,
    after_step: int,
    heatmap_from: int,
    metric: str,
    stat: str,
    group_by: str = "rank",
) -> LiveUpdate:
    """Only what is new since `after_step` (heatmap columns from `heatmap_from`)."""
    summary = query.job_summary(engine, job_id)
    first = after_step + 1
    got = _gather(
        {
            "band": lambda: query.step_band(engine, job_id, from_step=first),
            "tokens": lambda: query.step_series(engine, job_id, "tokens_per_s", from_step=first),
            "mfu": lambda: query.step_series(engine, job_id, "mfu", from_step=first),
            "heatmap": lambda: heatmap(
                engine,
                job_id,
                summary.world_size,
                metric=metric,
                stat=stat,
                group_by=group_by,
                from_step=heatmap_from,
            ),
            "findings": lambda: query.findings(engine, job_id),
        }
    )
    return LiveUpdate(summary=summary, **got)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPage:
    """Everything the rank page draws."""

    summary: query.JobSummary
    rank: int
    node: str | None
    mine: dict[str, query.Series]
    job: dict[str, query.Series]
    table: query.RankTable
    """The job's rank table (this rank's row, its node's other ranks)."""
    findings: list[query.StoredFinding]
    """The job's findings naming this rank or its node."""
    gpu: query.GpuSeries | None


RANK_METRICS = ("step_s", "compute_s", "data_s", "comm_wait_s")


def rank_page(engine: sa.Engine, job_id: str, rank: int) -> RankPage:
    """The rank page's data; JobNotFound for an unknown job, ValueError for an unseen rank."""
    summary = query.job_summary(engine, job_id)
    calls: dict[str, Callable[[], Any]] = {
        "table": lambda: query.rank_table(engine, job_id),
        "findings": lambda: query.findings(engine, job_id),
        "gpu": lambda: query.gpu_series(engine, job_id, rank=rank, max_points=GPU_POINTS),
    }
    for m in RANK_METRICS:
        calls[f"mine:{m}"] = _rank_series(engine, job_id, m, rank)
        calls[f"job:{m}"] = _job_series(engine, job_id, m)
    got = _gather(calls)
    table: query.RankTable = got["table"]
    at = [i for i, r in enumerate(table.rank.tolist()) if r == rank]
    named = set(table.finding_ids[at[0]]) if at else set()
    return RankPage(
        summary=summary,
        rank=rank,
        node=table.node[at[0]] if at else None,
        mine={m: got[f"mine:{m}"] for m in RANK_METRICS},
        job={m: got[f"job:{m}"] for m in RANK_METRICS},
        table=table,
        findings=[f for f in got["findings"] if f.id in named],
        gpu=got["gpu"],
    )


def _rank_series(engine: sa.Engine, job_id: str, metric: str, rank: int) -> Callable[[], Any]:
    return lambda: query.step_series(engine, job_id, metric, rank=rank, max_points=MAX_POINTS)


def _job_series(engine: sa.Engine, job_id: str, metric: str) -> Callable[[], Any]:
    return lambda: query.step_series(engine, job_id, metric, "p50", max_points=MAX_POINTS)


@dataclass(frozen=True, slots=True, kw_only=True)
class ComparePage:
    """Two jobs: the comparison, and their series to overlay."""

    comparison: query.Comparison
    step_s: tuple[query.Series, query.Series]
    tokens: tuple[query.Series, query.Series]
    mfu: tuple[query.Series, query.Series]


def compare_page(engine: sa.Engine, baseline: str, candidate: str) -> ComparePage:
    """query.compare of the two jobs and their series; JobNotFound names the unknown one."""
    comparison = query.compare(engine, baseline, candidate)
    calls: dict[str, Callable[[], Any]] = {}
    for key, metric in (("step_s", "step_s"), ("tokens", "tokens_per_s"), ("mfu", "mfu")):
        for job in (baseline, candidate):
            calls[f"{key}:{job}"] = _series(engine, job, metric)
    got = _gather(calls)
    pair = {
        key: (got[f"{key}:{baseline}"], got[f"{key}:{candidate}"])
        for key in ("step_s", "tokens", "mfu")
    }
    return ComparePage(comparison=comparison, **pair)


def _series(engine: sa.Engine, job_id: str, metric: str) -> Callable[[], Any]:
    return lambda: query.step_series(engine, job_id, metric, max_points=MAX_POINTS)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobsBlock:
    """Rows startRow..endRow of the jobs grid, the row count once known, the cursors."""

    rows: list[query.JobRow]
    last_row: int | None
    cursors: dict[str, str]
    """Row number → list_jobs cursor of the page starting there."""


def jobs_block(
    engine: sa.Engine,
    filters: query.JobFilters,
    sort: str,
    start_row: int,
    end_row: int,
    cursors: dict[str, str],
) -> JobsBlock:
    """The jobs of rows [start_row, end_row) in `sort` order: read from the nearest known
    cursor at or before start_row (keyset pages, so a block deep in the list is cheap
    once the blocks before it were seen)."""
    known = [int(k) for k in cursors if int(k) <= start_row]
    at = max(known, default=0)
    cursor = cursors.get(str(at)) if at else None
    cursors = dict(cursors)
    rows: list[query.JobRow] = []
    while True:
        want = end_row - at if at >= start_row else min(start_row - at, MAX_LIMIT)
        page = query.list_jobs(
            engine, filters, sort=sort, cursor=cursor, limit=min(max(want, 1), MAX_LIMIT)
        )
        if at >= start_row:
            rows.extend(page.jobs)
        at += len(page.jobs)
        cursor = page.next_cursor
        if cursor is None:
            return JobsBlock(rows=rows[: end_row - start_row], last_row=at, cursors=cursors)
        cursors[str(at)] = cursor
        if at >= end_row:
            return JobsBlock(rows=rows[: end_row - start_row], last_row=None, cursors=cursors)


def job_duration_s(row: query.JobRow | query.JobSummary, now: float) -> float | None:
    """Wall time from start to end (or to the last batch, or now, while running)."""
    if row.started_at is None:
        return None
    end = row.ended_at or row.last_seen or now
    return max(end - row.started_at, 0.0) if math.isfinite(end) else None
