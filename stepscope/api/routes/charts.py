"""A job's series, per-rank table, heatmap, collectives and GPU telemetry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import APIRouter, Query

from stepscope import query
from stepscope.api.deps import MAX_RANK, MAX_STEP, NO_NUL, EngineDep, JobIdDep, ReadAuth
from stepscope.api.errors import JOB_RESPONSES
from stepscope.api.schemas import (
    CollectivesRead,
    GpuRead,
    HeatmapRead,
    MeshRead,
    RankTableRead,
    SeriesRead,
)

if TYPE_CHECKING:
    SeriesMetric = str
    SeriesAgg = str
    HeatmapMetric = str
    HeatmapStat = str
else:
    SeriesMetric = Literal[query.SERIES_METRICS]
    SeriesAgg = Literal[query.SERIES_AGGREGATES]
    HeatmapMetric = Literal[query.HEATMAP_METRICS]
    HeatmapStat = Literal[query.HEATMAP_STATS]

router = APIRouter(tags=["charts"], responses=JOB_RESPONSES)

MAX_POINTS = 10_000
Rank = Annotated[int | None, Query(ge=0, le=MAX_RANK, description="One rank's values")]
FromStep = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="First step (inclusive)")]
ToStep = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="Last step (inclusive)")]
GroupBy = Annotated[
    str,
    Query(
        min_length=1,
        max_length=64,
        pattern=NO_NUL,
        description="rank, node, or a dimension of the job's mesh (GET /jobs/{job_id}/mesh "
        "lists them)",
    ),
]


@router.get("/jobs/{job_id}/timeseries", summary="A metric over steps")
def timeseries(
    engine: EngineDep,
    job_id: JobIdDep,
    _auth: ReadAuth,
    metric: SeriesMetric = "step_s",
    agg: Annotated[
        SeriesAgg,
        Query(description="Across ranks, for step_s, data_s, comm_wait_s and compute_s"),
    ] = "median",
    rank: Rank = None,
    from_step: FromStep = None,
    to_step: ToStep = None,
    max_points: Annotated[int, Query(ge=2, le=MAX_POINTS)] = 2000,
) -> SeriesRead:
    """A time component aggregated across ranks (or one rank's), or a job-level rate, per
    step; downsampled to at most max_points keeping the global min and max."""
    series = query.step_series(
        engine,
        job_id,
        metric,
        agg,
        from_step=from_step,
        to_step=to_step,
        max_points=max_points,
        rank=rank,
    )
    return SeriesRead.of(series)


@router.get("/jobs/{job_id}/ranks", summary="Per-rank table")
def ranks(
    engine: EngineDep, job_id: JobIdDep, _auth: ReadAuth, group_by: GroupBy = "rank"
) -> RankTableRead:
    """Every rank: node, time components, excess over the job's median rank, share of steps
    as the slowest rank, and the ids of its findings; slowest first. Grouped by node or a
    mesh dimension, also each group: the median and max over its ranks."""
    table = query.rank_table(engine, job_id)
    if group_by == "rank":
        return RankTableRead.of(table)
    return RankTableRead.of(table, query.rank_groups(engine, job_id, group_by))


@router.get("/jobs/{job_id}/mesh", summary="DeviceMesh")
def mesh(engine: EngineDep, job_id: JobIdDep, _auth: ReadAuth) -> MeshRead:
    """The mesh dimensions and sizes the job's ranks sent, each rank's coordinates, and the
    groupings of the heatmap and the rank table (no dimension for a job without a mesh)."""
    return MeshRead.of(query.job_mesh(engine, job_id))


@router.get("/jobs/{job_id}/heatmap", summary="Rank × step heatmap")
def heatmap(
    engine: EngineDep,
    job_id: JobIdDep,
    _auth: ReadAuth,
    metric: HeatmapMetric = "compute_s",
    stat: Annotated[HeatmapStat, Query(description="Of each cell's steps and ranks")] = "mean",
    group_by: GroupBy = "rank",
    max_ranks: Annotated[int, Query(ge=1, le=4096, description="Rows at most")] = 1024,
    max_steps: Annotated[int, Query(ge=1, le=4096, description="Columns at most")] = 1000,
    from_step: FromStep = None,
    to_step: ToStep = None,
) -> HeatmapRead:
    """The job's ranks × steps, bucketed on both axes, with the bucket edges (an empty grid
    before the job's first rollup); rows of ranks, or of nodes or mesh coordinates."""
    heat = query.heatmap(
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
    return HeatmapRead.of(heat, metric, stat, group_by)


@router.get("/jobs/{job_id}/collectives", summary="Collective bandwidth")
def collectives(
    engine: EngineDep,
    job_id: JobIdDep,
    _auth: ReadAuth,
    max_points: Annotated[
        int, Query(ge=2, le=MAX_POINTS, description="Per (group, op) series")
    ] = 2000,
) -> CollectivesRead:
    """Bus and algorithm bandwidth per process group (its label: mesh dim, "group <name>",
    "all") and op, by message-size bucket and over steps."""
    return CollectivesRead.of(query.collective_stats(engine, job_id, max_points=max_points))


@router.get("/jobs/{job_id}/gpu", summary="GPU telemetry")
def gpu(
    engine: EngineDep,
    job_id: JobIdDep,
    _auth: ReadAuth,
    rank: Rank = None,
    max_points: Annotated[int, Query(ge=2, le=MAX_POINTS, description="Time buckets")] = 1000,
) -> GpuRead:
    """Per device of one rank, or the spread across the job's devices, per time bucket."""
    return GpuRead.of(query.gpu_series(engine, job_id, rank=rank, max_points=max_points), rank)
