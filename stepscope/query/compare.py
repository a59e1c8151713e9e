"""Two jobs side by side: both summaries and their differences per metric and time component."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import sqlalchemy as sa

from stepscope.query.series import step_series
from stepscope.query.summary import JobSummary, job_summary

METRICS = ("step_p50_s", "step_p90_s", "tokens_per_s", "samples_per_s", "mfu")
"""Summary figures compared; step times are better lower, the rates higher."""
COMPONENTS = ("data", "compute", "comm_wait")
"""Time components of a step compared: their share of the step and their seconds."""
_LOWER_IS_BETTER = {"step_p50_s", "step_p90_s"}
_ALL_STEPS = 2**62
"""max_points that leaves a step series whole (no downsampling)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Difference:
    """One figure of both jobs: candidate − baseline, and candidate / baseline − 1."""

    name: str
    baseline: float | None
    candidate: float | None
    difference: float | None
    relative: float | None
    """None when either value is unknown or the baseline is 0."""
    higher_is_better: bool | None
    """None where neither direction is better (a component's share)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentDifference:
    """A time component of the step: its share of the ranks' step time, and its seconds per
    step (median over steps of the median across ranks)."""

    component: str
    share: Difference
    seconds: Difference


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """A candidate job against a baseline job."""

    baseline: JobSummary
    candidate: JobSummary
    same_benchmark_key: bool
    """Both jobs have the same (non-empty) benchmark_key: the figures are comparable."""
    metrics: list[Difference]
    components: list[ComponentDifference]


def compare(engine: sa.Engine, baseline: str, candidate: str) -> Comparison:
    """Both jobs' summaries and their differences; raises JobNotFound for an unknown job."""
    base, cand = job_summary(engine, baseline), job_summary(engine, candidate)
    metrics = [
        difference(
            name,
            getattr(base, name),
            getattr(cand, name),
            higher_is_better=name not in _LOWER_IS_BETTER,
        )
        for name in METRICS
    ]
    components = [
        ComponentDifference(
            component=c,
            share=difference(
                f"{c}_share",
                getattr(base, f"{c}_share"),
                getattr(cand, f"{c}_share"),
                higher_is_better=None,
            ),
            seconds=difference(
                f"{c}_s",
                _typical_s(engine, baseline, f"{c}_s"),
                _typical_s(engine, candidate, f"{c}_s"),
                higher_is_better=False,
            ),
        )
        for c in COMPONENTS
    ]
    return Comparison(
        baseline=base,
        candidate=cand,
        same_benchmark_key=bool(base.benchmark_key) and base.benchmark_key == cand.benchmark_key,
        metrics=metrics,
        components=components,
    )


def difference(
    name: str, baseline: float | None, candidate: float | None, *, higher_is_better: bool | None
) -> Difference:
    """The Difference of two values, either of which may be unknown (None or NaN)."""
    base = _known(baseline)
    cand = _known(candidate)
    both = base is not None and cand is not None
    return Difference(
        name=name,
        baseline=base,
        candidate=cand,
        difference=cand - base if both else None,  # type: ignore[operator]
        relative=cand / base - 1.0 if both and base != 0 else None,  # type: ignore[operator]
        higher_is_better=higher_is_better,
    )


def _known(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _typical_s(engine: sa.Engine, job_id: str, metric: str) -> float | None:
    """Median over a job's rolled-up steps of the median across ranks of `metric`."""
    series = step_series(engine, job_id, metric, "p50", max_points=_ALL_STEPS)
    return float(np.median(series.value)) if series.value.size else None
