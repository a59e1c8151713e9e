"""Fleet health (docs/fleet.md): nodes ranked by their own effect on step time, and one
node's jobs, GPUs and findings.

The model reads every job's stored node levels. They are kept in memory per database and
brought up to date by reading only the rows written since (a finished job adds its own), so
recomputing after a job finishes reads one job's rows and updates the previous fit by them;
a deleted or replaced job refits, and a deleted job (fewer rows than the cache holds) makes
the next read a full one.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import polars as pl
import sqlalchemy as sa

from stepscope.analysis.fleet.health import FleetConfig, FleetHealth, add_jobs, fleet_health
from stepscope.query.common import check_choice
from stepscope.schema import expand_ranks
from stepscope.store import jobs, node_levels, reads

log = logging.getLogger(__name__)

SORT_KEYS = ("effect", "confidence", "num_jobs", "node", "since")
NODE_FINDING_KINDS = ("straggler_rank", "straggler_node", "gpu_throttling", "slow_collective")
"""Findings a node's page lists when they name the node or one of its ranks in a job."""


class NodeNotFound(LookupError):
    """No job stored a level of this node."""

    def __init__(self, node: str) -> None:
        super().__init__(f"no job has stored a level of node {node!r}")
        self.node = node


@dataclass(slots=True)
class _Cached:
    count: int
    latest: float
    levels: pl.DataFrame
    health: FleetHealth | None = None
    start: pl.DataFrame | None = None
    """The previous fit's offsets and effects, where the next fit starts."""
    previous: FleetHealth | None = None
    """The previous fit, when `added` holds every row since (new jobs only)."""
    added: pl.DataFrame | None = None
    refitting: bool = False


_cache: dict[str, _Cached] = {}
_lock = threading.Lock()
_REFIT_SHARE = 0.01
"""A full fit follows (in the background) once jobs added locally exceed this share of the
fleet's jobs (and _REFIT_MIN_JOBS): the noise and the prior stay true, every offset moves."""
_REFIT_MIN_JOBS = 20


def fleet_levels(engine: sa.Engine) -> pl.DataFrame:
    """Every job's node rows (node_levels.FLEET_COLUMNS) in time order, read incrementally."""
    return _current(engine).levels


def _current(engine: sa.Engine) -> _Cached:
    key = engine.url.render_as_string()
    count, latest = node_levels.stamp(engine)
    with _lock:
        cached = _cache.get(key)
    if cached is not None and (cached.count, cached.latest) == (count, latest):
        return cached
    levels: pl.DataFrame | None = None
    added = None
    if cached is not None and math.isfinite(cached.latest):
        fresh = node_levels.read_fleet_levels(engine, updated_after=cached.latest)
        kept = cached.levels.filter(~pl.col("job_id").is_in(fresh["job_id"].unique().implode()))
        merged = pl.concat([kept, fresh], rechunk=True)
        if merged.height == count:
            levels = merged if _in_time_order(merged) else merged.sort("ts", "job_id")
            added = fresh if kept.height == cached.levels.height else None
    if levels is None:
        levels = node_levels.read_fleet_levels(engine).sort("ts", "job_id")
    entry = _Cached(count=levels.height, latest=latest, levels=levels)
    if cached is not None:
        entry.start = cached.health.fit if cached.health is not None else cached.start
        entry.previous, entry.added = cached.health, added
    with _lock:
        _cache[key] = entry
    return entry


def _in_time_order(levels: pl.DataFrame) -> bool:
    """Whether the rows are sorted by ts (the fit's fast path: its sort keeps that order)."""
    ts = levels["ts"].fill_null(0.0)
    return bool((ts.diff().fill_null(0.0) >= 0).all())


def health(engine: sa.Engine, config: FleetConfig | None = None) -> FleetHealth:
    """The fitted fleet: after new jobs, the previous fit updated by them (`add_jobs`, a full
    fit following in the background now and then); otherwise refitted."""
    entry = _current(engine)
    if config is not None:
        return fleet_health(entry.levels, config)
    if entry.health is None:
        if entry.previous is not None and entry.added is not None:
            entry.health = add_jobs(entry.previous, entry.added)
        if entry.health is None:
            entry.health = fleet_health(entry.levels, start=entry.start)
        entry.previous = entry.added = None
    state = entry.health.state
    if state is not None and state.num_added_jobs > max(
        _REFIT_MIN_JOBS, _REFIT_SHARE * len(state.job_names)
    ):
        _refit_in_background(entry)
    return entry.health


def _refit_in_background(entry: _Cached) -> None:
    """Fit the entry's levels in full on a thread of its own; its health once done."""
    with _lock:
        if entry.refitting:
            return
        entry.refitting = True

    def refit() -> None:
        try:
            start = entry.health.fit if entry.health is not None else entry.start
            entry.health = fleet_health(entry.levels, start=start)
        except Exception:
            log.exception("the background fit of fleet health failed")
        finally:
            entry.refitting = False

    threading.Thread(target=refit, name="stepscope-fleet-fit", daemon=True).start()


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeFilters:
    """Which nodes a list holds."""

    suspect: bool = False
    """Only the suspects."""
    name_contains: str | None = None
    min_effect: float | None = None
    min_confidence: float | None = None
    min_jobs: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeList:
    """A sorted, filtered list of nodes, and the fleet's figures."""

    nodes: list[dict[str, Any]]
    """NodeRow-like dicts (the columns of FleetHealth.nodes)."""
    num_nodes: int
    """Nodes in the fleet (before filters)."""
    num_suspects: int
    num_jobs: int
    tau: float
    """Job-to-job noise of a node (relative)."""
    prior_sd: float


def list_nodes(
    engine: sa.Engine,
    filters: NodeFilters | None = None,
    *,
    sort: str = "-effect",
    limit: int = 100,
) -> NodeList:
    """Nodes that pass the filters in `sort` order (a leading '-' descends), at most `limit`."""
    key = sort.removeprefix("-")
    check_choice("sort", key, SORT_KEYS)
    if limit < 1:
        raise ValueError(f"limit must be >= 1; got {limit}")
    f = filters or NodeFilters()
    fitted = health(engine)
    table = fitted.nodes
    if f.suspect:
        table = table.filter(pl.col("suspect"))
    if f.name_contains:
        table = table.filter(pl.col("node").str.contains(f.name_contains, literal=True))
    if f.min_effect is not None:
        table = table.filter(pl.col("effect") >= f.min_effect)
    if f.min_confidence is not None:
        table = table.filter(pl.col("confidence") >= f.min_confidence)
    if f.min_jobs is not None:
        table = table.filter(pl.col("num_jobs") >= f.min_jobs)
    descending = sort.startswith("-")
    by = [key, "confidence" if key != "confidence" else "effect", "node"]
    table = table.sort(by, descending=[descending, True, False], nulls_last=True)
    return NodeList(
        nodes=table.head(limit).to_dicts(),
        num_nodes=fitted.nodes.height,
        num_suspects=int(fitted.nodes["suspect"].sum()) if fitted.nodes.height else 0,
        num_jobs=int(fitted.jobs["job_id"].n_unique()) if fitted.jobs.height else 0,
        tau=math.expm1(fitted.tau),
        prior_sd=math.expm1(fitted.prior_sd),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeDetail:
    """One node: its fitted row, its jobs over time, its GPUs and the findings naming it."""

    node: dict[str, Any]
    jobs: list[dict[str, Any]]
    """Oldest first: job_id, name, ts, ranks, residual (relative), score, current."""
    gpus: list[dict[str, Any]]
    """Per GPU UUID: ranks seen on, num_jobs, median and last excess (relative, less each
    job's offset), last_ts."""
    findings: list[dict[str, Any]]
    """The findings of its jobs that name it or one of its ranks there (with job_id)."""


def node_detail(engine: sa.Engine, node: str) -> NodeDetail:
    """The node's page; NodeNotFound if no job stored a level of it."""
    rows = node_levels.read_node_rows(engine, node)
    if rows.is_empty():
        raise NodeNotFound(node)
    fitted = health(engine)
    row = fitted.nodes.filter(pl.col("node") == node).to_dicts()
    own = rows.filter(pl.col("gpu") == "")
    per_job = own.select("job_id", "ts", "ranks", pl.col("excess").exp().sub(1).alias("level"))
    scored = fitted.jobs.filter(pl.col("node") == node).select(
        "job_id", "residual", "score", "current"
    )
    job_rows = per_job.join(scored, on="job_id", how="left").sort("ts", "job_id")
    names = jobs.job_names(engine, job_rows["job_id"].to_list())
    job_list = [{**j, "name": names.get(j["job_id"])} for j in job_rows.to_dicts()]
    return NodeDetail(
        node=row[0] if row else _unfitted(node, own),
        jobs=job_list,
        gpus=_gpus(rows.filter(pl.col("gpu") != ""), job_rows),
        findings=_findings(engine, node, own),
    )


def _unfitted(node: str, own: pl.DataFrame) -> dict[str, Any]:
    """A node no fit covers (its jobs had one node only): its figures without an effect."""
    return {
        "node": node,
        "effect": None,
        "raw_effect": None,
        "se": None,
        "confidence": 0.0,
        "z": 0.0,
        "num_jobs": 0,
        "num_jobs_total": own.height,
        "since": None,
        "first_ts": own["ts"].min(),
        "last_ts": own["ts"].max(),
        "suspect": False,
    }


def _gpus(rows: pl.DataFrame, job_rows: pl.DataFrame) -> list[dict[str, Any]]:
    """Per GPU, its excess over its jobs' medians less each job's fitted offset (what the
    model takes off the node's level, e.g. in a two-node job whose median it moved)."""
    if rows.is_empty():
        return []
    offsets = job_rows.select(
        "job_id",
        (pl.col("level").log1p() - pl.col("residual").log1p()).fill_null(0.0).alias("offset"),
    )
    table = (
        rows.join(offsets, on="job_id", how="left")
        .with_columns(pl.col("excess") - pl.col("offset").fill_null(0.0))
        .sort("ts")
        .group_by("gpu", maintain_order=True)
        .agg(
            pl.col("ranks").unique().sort().str.join(",").alias("ranks"),
            pl.len().alias("num_jobs"),
            pl.col("excess").median().exp().sub(1).alias("median_excess"),
            pl.col("excess").last().exp().sub(1).alias("last_excess"),
            pl.col("ts").last().alias("last_ts"),
        )
        .sort("median_excess", descending=True)
    )
    return table.to_dicts()


def _findings(engine: sa.Engine, node: str, own: pl.DataFrame) -> list[dict[str, Any]]:
    node_ranks = dict(zip(own["job_id"].to_list(), own["ranks"].to_list(), strict=True))
    out = []
    for f in reads.read_findings_of_jobs(engine, list(node_ranks), NODE_FINDING_KINDS):
        ranks = expand_ranks(node_ranks[f["job_id"]])
        if f.get("node") == node or (ranks is not None and set(f.get("ranks") or ()) & set(ranks)):
            out.append(f)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetMap:
    """Nodes × time: each node's mean residual (relative) over its jobs in each time bin."""

    nodes: list[str]
    """Rows, most suspect first (the list's order)."""
    bin_starts: list[float]
    """Epoch s of each column's start."""
    bin_s: float
    values: list[list[float | None]]
    """nodes × bins; None where the node ran no job in the bin."""
    num_jobs: list[list[int]]


def fleet_map(engine: sa.Engine, *, max_nodes: int = 40, num_bins: int = 24) -> FleetMap:
    """The heatmap of the `max_nodes` first nodes of the default list (suspects, then by
    effect) over `num_bins` equal time bins from the first job to the last."""
    if max_nodes < 1 or num_bins < 1:
        raise ValueError("max_nodes and num_bins must be >= 1")
    fitted = health(engine)
    top = fitted.nodes.head(max_nodes)["node"].to_list()
    jobs = fitted.jobs.filter(pl.col("node").is_in(top))
    if jobs.is_empty():
        return FleetMap(nodes=[], bin_starts=[], bin_s=0.0, values=[], num_jobs=[])
    t0, t1 = float(jobs["ts"].min()), float(jobs["ts"].max())  # type: ignore[arg-type]
    bin_s = max((t1 - t0) / num_bins, 1.0)
    cells = (
        jobs.with_columns(((pl.col("ts") - t0) / bin_s).floor().clip(0, num_bins - 1).alias("b"))
        .group_by("node", "b")
        .agg(pl.col("residual").mean().alias("v"), pl.len().alias("n"))
    )
    row = {n: i for i, n in enumerate(top)}
    values: list[list[float | None]] = [[None] * num_bins for _ in top]
    counts = [[0] * num_bins for _ in top]
    for node, b, v, n in cells.iter_rows():
        values[row[node]][int(b)] = float(v)
        counts[row[node]][int(b)] = int(n)
    return FleetMap(
        nodes=top,
        bin_starts=[t0 + i * bin_s for i in range(num_bins)],
        bin_s=bin_s,
        values=values,
        num_jobs=counts,
    )
