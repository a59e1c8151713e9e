"""The goodput response models (#20): what GET /api/v1/jobs/{id}/goodput and the fleet view
GET /api/v1/goodput answer."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

from stepscope.analysis.goodput.job import Goodput
from stepscope.query.goodput import JobGoodput
from stepscope.query.goodput_fleet import FleetGoodput
from stepscope.schema import GOODPUT_CATEGORIES


class CategoryRead(BaseModel):
    """One category's GPU-time."""

    gpu_s: float
    """GPU-seconds."""
    share: float
    """Of the job's (or the rank's) GPU-time, 0..1."""


class IncarnationRead(BaseModel):
    """One run of the job's processes, between two restarts."""

    index: int
    started_at: float
    ended_at: float
    num_ranks: int
    first_step: int | None
    last_step: int | None
    resumed_at: int | None
    """The step the next incarnation resumed at (steps from it on ran again)."""
    lost_steps: list[int] | None
    """[first, last] step run to its end whose progress was lost."""
    interrupted_step: int | None
    """The step an exception interrupted, when the profiler knew it."""
    failure: dict[str, Any] | None
    """The first exception of the incarnation: rank, ts, message."""
    hang_detection_s: float | None
    categories: dict[str, CategoryRead]


class RankGoodputRead(BaseModel):
    """One rank's goodput."""

    goodput: float
    categories: dict[str, CategoryRead]


class WindowRead(BaseModel):
    """One window of the job's wall time: its GPU-time by category."""

    start: float
    """Epoch seconds."""
    end: float
    gpu_s: float
    """The job's GPU-time inside the window (world size × its part of the job's span)."""
    categories: dict[str, float]
    """GPU-seconds per category; they add up to gpu_s."""


class GoodputRead(BaseModel):
    """A job's goodput (docs/goodput.md): every GPU-second in one category."""

    job_id: str
    world_size: int
    started_at: float | None
    """The first rank's process start (epoch s)."""
    ended_at: float | None
    """The job's last recorded activity (epoch s)."""
    total_gpu_s: float
    goodput: float
    """productive / total, 0..1."""
    ideal_step_s: float | None
    layers: dict[str, float | None]
    """Google's layers: scheduling, runtime, program and their product."""
    categories: dict[str, CategoryRead]
    incarnations: list[IncarnationRead]
    responsible: dict[str, list[dict[str, Any]]]
    """Category → the ranks (or node), cause or exception behind it."""
    ranks: dict[int, RankGoodputRead] | None
    """Per rank, with per_rank=true."""
    window_s: float | None
    """The windows' length, seconds."""
    windows: list[WindowRead]
    """Goodput over time: consecutive windows from the job's start; restarts are the
    incarnations' started_at."""


def _categories(values: dict[str, float], total_s: float) -> dict[str, CategoryRead]:
    return {
        c: CategoryRead(gpu_s=v, share=v / total_s if total_s > 0 else 0.0)
        for c, v in values.items()
    }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _rank_read(result: Goodput) -> RankGoodputRead:
    return RankGoodputRead(
        goodput=result.goodput, categories=_categories(result.categories, result.total_s)
    )


def goodput_read(answer: JobGoodput) -> GoodputRead:
    """The response of a job's goodput."""
    r = answer.result
    return GoodputRead(
        job_id=answer.job_id,
        world_size=r.world_size,
        started_at=_finite(r.started_at),
        ended_at=_finite(r.ended_at),
        total_gpu_s=r.total_s,
        goodput=r.goodput,
        ideal_step_s=r.ideal_step_s,
        layers=r.layers,
        categories=_categories(r.categories, r.total_s),
        incarnations=[
            IncarnationRead(
                index=i.index,
                started_at=i.started_at,
                ended_at=i.ended_at,
                num_ranks=i.num_ranks,
                first_step=i.first_step,
                last_step=i.last_step,
                resumed_at=i.resumed_at,
                lost_steps=i.lost_steps,
                interrupted_step=i.interrupted_step,
                failure=i.failure,
                hang_detection_s=i.hang_detection_s,
                categories=_categories(i.categories, r.total_s),
            )
            for i in r.incarnations
        ],
        responsible=answer.responsible,
        ranks=None
        if answer.ranks is None
        else {rank: _rank_read(g) for rank, g in answer.ranks.items()},
        window_s=answer.window_s,
        windows=_windows(answer),
    )


def _windows(answer: JobGoodput) -> list[WindowRead]:
    if answer.windows is None:
        return []
    return [
        WindowRead(
            start=row["start"],
            end=row["end"],
            gpu_s=row["gpu_s"],
            categories={c: row[c] for c in GOODPUT_CATEGORIES},
        )
        for row in answer.windows.iter_rows(named=True)
    ]


class FleetCategoryRead(BaseModel):
    """One category's GPU-time over the fleet."""

    gpu_hours: float
    share: float
    """Of the window's GPU-time over all jobs, 0..1."""


class FleetJobRead(BaseModel):
    """One job's GPU-time inside the window."""

    job_id: str
    name: str | None
    world_size: int
    gpu_hours: float
    goodput: float
    """productive / the job's GPU-time inside the window."""
    categories: dict[str, float]
    """GPU-hours per category inside the window."""


class FleetGoodputRead(BaseModel):
    """Goodput over every job that ran between since and until (docs/goodput.md)."""

    since: float
    until: float
    num_jobs: int
    gpu_hours: float
    """The jobs' GPU-time inside the window (a job across an edge: its part)."""
    goodput: float
    categories: dict[str, FleetCategoryRead]
    jobs: list[FleetJobRead]
    """Most GPU-hours lost first."""


def fleet_read(answer: FleetGoodput) -> FleetGoodputRead:
    """The response of the fleet view."""
    return FleetGoodputRead(
        since=answer.since,
        until=answer.until,
        num_jobs=len(answer.jobs),
        gpu_hours=answer.gpu_s / 3600,
        goodput=answer.goodput,
        categories={
            c: FleetCategoryRead(
                gpu_hours=v / 3600, share=v / answer.gpu_s if answer.gpu_s > 0 else 0.0
            )
            for c, v in answer.categories.items()
        },
        jobs=[
            FleetJobRead(
                job_id=j.job_id,
                name=j.name,
                world_size=j.world_size,
                gpu_hours=j.gpu_s / 3600,
                goodput=j.categories["productive"] / j.gpu_s,
                categories={c: v / 3600 for c, v in j.categories.items()},
            )
            for j in answer.jobs
        ],
    )
