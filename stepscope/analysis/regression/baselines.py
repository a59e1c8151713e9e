"""Which baseline jobs to compare with: those after the last level shift of their history.

A benchmark's history has known shifts (a faster kernel merged, a new driver): comparing a
candidate with jobs from before one mixes two levels. The jobs' levels (log units, in time
order) are split where a two-sample t test of the segments is significant (Bonferroni over
the positions tried) and the shift is at least the effect floor; splitting repeats on the
part after the split, so the last such shift is found. A rank test would need more jobs than
a CI history has: 5 jobs on each side of a 10% shift are only just significant by ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from stepscope.analysis.frames.steady import COMPONENTS, JobLevels
from stepscope.analysis.stats.student_t import t_sf

MIN_SEGMENT_JOBS = 2
"""Fewest jobs on each side of a shift."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DroppedBaseline:
    job_id: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Shift:
    """A level shift in a series of job levels: the new level starts at `index`."""

    index: int
    effect: float
    """exp(mean after − mean before) − 1."""
    p_value: float


def last_shift(levels: NDArray[np.float64], *, alpha: float, min_effect: float) -> Shift | None:
    """The latest significant shift of at least `min_effect` in `levels` (time order)."""
    found = None
    start = 0
    while True:
        shift = _best_split(levels[start:])
        if shift is None or shift.p_value > alpha or abs(shift.effect) < min_effect:
            return found
        found = Shift(index=start + shift.index, effect=shift.effect, p_value=shift.p_value)
        start = found.index


def _best_split(z: NDArray[np.float64]) -> Shift | None:
    m = MIN_SEGMENT_JOBS
    n = z.size
    if n < 2 * m:
        return None
    best: tuple[float, int, float] | None = None
    for k in range(m, n - m + 1):
        a, b = z[:k], z[k:]
        sse = float(((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum())
        diff = float(b.mean() - a.mean())
        scale = math.sqrt(sse / (n - 2) * (1.0 / k + 1.0 / (n - k))) if n > 2 else 0.0
        t = abs(diff) / scale if scale > 0 else (math.inf if diff else 0.0)
        if best is None or t > best[0]:
            best = (t, k, diff)
    assert best is not None
    t, k, diff = best
    positions = n - 2 * m + 1
    p_value = 0.0 if math.isinf(t) else min(1.0, 2.0 * t_sf(t, n - 2) * positions)
    return Shift(index=k, effect=math.expm1(diff), p_value=p_value)


def drop_before_shift(
    baselines: Sequence[JobLevels], metrics: Sequence[str], *, alpha: float, min_effect: float
) -> tuple[set[str], list[DroppedBaseline]]:
    """(ids kept, dropped with the reason) of baselines in time order: each metric's last
    shift is found, and the jobs before the latest of them are dropped. A component's shift
    counts from `min_effect` of the baselines' step time, as its verdict does: +8% of a
    0.2 ms data_s in a 58 ms step is no shift of the job's level."""
    cut, why = 0, ""
    step_s = _mean_level(baselines, "step_s")
    for metric in metrics:
        present = [b for b in baselines if metric in b.levels]
        if len(present) < len(baselines):
            continue
        z = np.array([b.levels[metric].log_value for b in present])
        floor = min_effect
        if metric in COMPONENTS and step_s is not None:
            floor = min_effect * step_s / math.exp(float(z.mean()))
        shift = last_shift(z, alpha=alpha, min_effect=floor)
        if shift is not None and shift.index > cut:
            cut = shift.index
            why = (
                f"before a {shift.effect:+.1%} shift of {metric} at {baselines[cut].job_id} "
                f"(p = {shift.p_value:.2g})"
            )
    dropped = [DroppedBaseline(job_id=b.job_id, reason=why) for b in baselines[:cut]]
    return {b.job_id for b in baselines[cut:]}, dropped


def _mean_level(baselines: Sequence[JobLevels], metric: str) -> float | None:
    """The geometric mean of a metric's level over the baselines (None unless all have it)."""
    if not baselines or any(metric not in b.levels for b in baselines):
        return None
    return math.exp(float(np.mean([b.levels[metric].log_value for b in baselines])))
