"""What a goodput computation answers (docs/goodput.md): the job's categories, Google's
layers, its incarnations, and its GPU-seconds placed in time (windows)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from stepscope.analysis.goodput.timeline import Ledger, default_window_s, window_edges, windowed
from stepscope.schema import GOODPUT_CATEGORIES


@dataclass(kw_only=True, slots=True)
class Incarnation:
    """One run of the job's processes, between two restarts."""

    index: int
    started_at: float
    ended_at: float
    num_ranks: int
    first_step: int | None
    last_step: int | None
    resumed_at: int | None
    """The step the next incarnation resumed at; steps from it on ran again (lost)."""
    lost_steps: list[int] | None
    """[first, last] step run to its end whose progress was lost, None when none was."""
    interrupted_step: int | None
    """The step an exception interrupted (the profiler's `step` attribute), if known."""
    categories: dict[str, float]
    """GPU-seconds per category inside this incarnation (restart downtime: after it)."""
    failure: dict[str, Any] | None
    """The first exception of the incarnation: {rank, ts, message}."""
    hang_detection_s: float | None
    """From the stall to its detection, when the incarnation hung."""


@dataclass(kw_only=True, slots=True)
class Goodput:
    """A job's goodput: the GPU-seconds of each category, and Google's three layers."""

    world_size: int
    started_at: float
    ended_at: float
    total_s: float
    """world_size × (ended_at − started_at): GPU-seconds."""
    categories: dict[str, float]
    goodput: float
    ideal_step_s: float | None
    layers: dict[str, float | None]
    """scheduling, runtime, program and their product (None when not known)."""
    incarnations: list[Incarnation] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)
    """Every category's GPU-seconds placed in time (for windows)."""

    def share(self, category: str) -> float:
        """A category's share of the job's GPU-time (0..1)."""
        return self.categories.get(category, 0.0) / self.total_s if self.total_s > 0 else 0.0


def empty_goodput(world_size: int) -> Goodput:
    """A job with no GPU-time yet."""
    return Goodput(
        world_size=world_size,
        started_at=math.nan,
        ended_at=math.nan,
        total_s=0.0,
        categories=dict.fromkeys(GOODPUT_CATEGORIES, 0.0),
        goodput=0.0,
        ideal_step_s=None,
        layers={"scheduling": None, "runtime": None, "program": None, "product": None},
    )


def windows(result: Goodput, window_s: float | None = None) -> pl.DataFrame:
    """Per window of `window_s` seconds (default: default_window_s of the job's span) from the
    job's start: start, end, gpu_s and every category's GPU-seconds (they add up to gpu_s)."""
    span_s = result.ended_at - result.started_at
    if not math.isfinite(span_s):
        return windowed(result.ledger, np.zeros(0), num_lanes=0, started_at=0.0, ended_at=0.0)
    window_s = window_s or default_window_s(span_s)
    return windowed(
        result.ledger,
        window_edges(result.started_at, result.ended_at, window_s),
        num_lanes=result.world_size,
        started_at=result.started_at,
        ended_at=result.ended_at,
    )


def within(result: Goodput, since: float, until: float) -> dict[str, float]:
    """The job's GPU-seconds inside [since, until): gpu_s and every category's."""
    # Clipped to the job's span first: the same sums, without far-off edges' rounding.
    since, until = max(since, result.started_at), min(until, result.ended_at)
    if not math.isfinite(result.started_at) or until <= since:
        return dict.fromkeys(("gpu_s", *GOODPUT_CATEGORIES), 0.0)
    frame = windowed(
        result.ledger,
        np.array([since, until], dtype=np.float64),
        num_lanes=result.world_size,
        started_at=result.started_at,
        ended_at=result.ended_at,
    )
    return {c: float(frame[c][0]) for c in ("gpu_s", *GOODPUT_CATEGORIES)}
