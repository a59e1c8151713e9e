"""The CI regression gate's statistics: is a candidate job slower than its baselines?

The job is the unit. Each job is summarised per metric by the log of a trimmed mean of its
steady-state steps (stepscope.analysis.frames.steady); steps inside a job are autocorrelated and
never count as independent samples. Per metric, with n baselines:

- n >= the fewest the alpha allows: a one-sided prediction interval of the baselines' levels
  (Student t, n − 1 degrees of freedom) at that metric's share of `alpha`. Metrics whose
  test statistics coincide (tokens/s when every step carries the same tokens is step time
  in other units) are one hypothesis. Hypotheses are corrected by weighted Holm: the
  step-time hypotheses hold `throughput_share` of alpha, the components the rest, and a
  rejected hypothesis passes its share on, so the family-wise false-fail rate stays <= alpha.
  A regression also needs the practical `min_effect` (components: of the step time).
- 2 <= n below that: inconclusive (too few baselines for the alpha).
- n = 1: the two jobs' steady-state steps compared by their levels and standard errors
  (batch means), with the effect floor: a weak verdict, as run-to-run noise is unknown.

Baselines before the last level shift of their history are dropped first
(stepscope.analysis.regression.baselines); a candidate whose own steps are far noisier than the
baselines' is inconclusive unless it clearly regressed. Improvements are reported and never
fail. Attribution (stepscope.analysis.regression.attribution) says which components and ranks moved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

from stepscope.analysis.frames.steady import (
    METRICS,
    JobLevels,
    detect_warmup,
    job_levels,
    job_metrics,
)
from stepscope.analysis.regression.attribution import (
    Attribution,
    component_changes,
    rank_attribution,
)
from stepscope.analysis.regression.baselines import DroppedBaseline, drop_before_shift
from stepscope.analysis.regression.metric_tests import (
    CheckConfig,
    MetricTest,
    MetricVerdict,
    Outcome,
    decide,
    weighted_holm,
)
from stepscope.analysis.regression.share_tests import decide_share, share_test
from stepscope.analysis.rollups import step_rollup, with_compute
from stepscope.schema import GOODPUT_METRICS

__all__ = [
    "METRICS",
    "CheckConfig",
    "CheckResult",
    "DroppedBaseline",
    "JobData",
    "MetricVerdict",
    "Outcome",
    "check_regression",
    "job_from_steps",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobData:
    """One job as the gate reads it: its step rollup and, optionally, per-rank levels."""

    job_id: str
    rollup: pl.DataFrame
    """Per step: num_ranks, step_s_max, data_s_max, comm_wait_s_min, tokens, mfu (columns of
    stepscope.analysis.rollups.step_rollup and of the stored step_rollups)."""
    ranks: pl.DataFrame | None = None
    """rank, node, data_s, compute_s: each rank's typical seconds per step."""
    started_at: float | None = None
    goodput: dict[str, float] | None = None
    """The shares of its GPU-time (GOODPUT_METRICS → 0..1), when its goodput is known."""


def job_from_steps(
    steps: pl.DataFrame,
    *,
    job_id: str | None = None,
    peak_flops: float | None = None,
    world_size: int | None = None,
    started_at: float | None = None,
) -> JobData:
    """JobData of one job's rows in the canonical steps schema (stepscope.schema.STEPS):
    its step rollup, and per rank the medians of data_s and compute_s after warm-up."""
    if steps.is_empty():
        raise ValueError("no steps")
    if job_id is None:
        job_id = str(steps["job_id"][0]) if "job_id" in steps.columns else "steps"
    rollup = step_rollup(steps, peak_flops=peak_flops, world_size=world_size)
    warmup = detect_warmup(job_metrics(rollup)["step_s"].to_numpy())
    first_steady = rollup["step"].sort()[min(warmup, rollup.height - 1)]
    per_rank = with_compute(steps.filter(pl.col("step") >= first_steady))
    node = [pl.col("node").drop_nulls().first()] if "node" in steps.columns else []
    ranks = (
        per_rank.group_by("rank")
        .agg(*node, pl.col("data_s", "compute_s").cast(pl.Float64).median())
        .sort("rank")
    )
    if started_at is None and "ts" in steps.columns:
        started_at = float(steps["ts"].cast(pl.Float64).min())  # type: ignore[arg-type]
    return JobData(job_id=job_id, rollup=rollup, ranks=ranks, started_at=started_at)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """The gate's verdict overall and per metric, with what it compared and why."""

    outcome: Outcome
    weak: bool
    candidates: list[str]
    baselines: list[str]
    """The baselines used, oldest first."""
    dropped: list[DroppedBaseline]
    metrics: list[MetricVerdict]
    attribution: Attribution | None
    notes: list[str]
    levels: list[JobLevels]
    """Candidates, then the baselines used: warm-up and steady steps of each."""
    config: CheckConfig = field(default_factory=CheckConfig)

    @property
    def baseline_missing(self) -> bool:
        """Inconclusive only for want of baselines (no other reason)."""
        inconclusive = [v for v in self.metrics if v.outcome == "inconclusive"]
        return (
            self.outcome == "inconclusive"
            and bool(inconclusive)
            and all(
                v.num_baselines < (v.min_baselines or 1) or v.num_baselines == 0
                for v in inconclusive
            )
        )

    def verdict(self, metric: str) -> MetricVerdict | None:
        """The verdict on `metric`, if it was tested."""
        return next((v for v in self.metrics if v.metric == metric), None)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data (non-finite numbers as None)."""
        doc = asdict(self)
        doc["levels"] = [
            {"job_id": j.job_id, "warmup_steps": j.warmup_steps, "steady_steps": j.num_steady_steps}
            for j in self.levels
        ]
        return _finite(doc)


def check_regression(
    candidates: Sequence[JobData],
    baselines: Sequence[JobData],
    config: CheckConfig,
    *,
    unusable: Sequence[DroppedBaseline] = (),
    notes: Sequence[str] = (),
) -> CheckResult:
    """The verdict on the candidate run(s) against the baseline jobs, per metric and overall;
    `unusable` baselines (that could not be read) and `notes` are reported with it."""
    if not candidates:
        raise ValueError("no candidate job")
    notes = list(notes)
    cand = [_levels(j, config) for j in candidates]
    short = [c for c in cand if c.num_steady_steps < config.min_steady_steps]
    notes += [f"candidate {c.job_id}: {_too_short(c)}" for c in short]

    usable: list[tuple[JobData, JobLevels]] = []
    dropped = list(unusable)
    for job in sorted(baselines, key=lambda j: math.inf if j.started_at is None else j.started_at):
        levels = _levels(job, config)
        if levels.num_steady_steps < config.min_steady_steps or "step_s" not in levels.levels:
            dropped.append(DroppedBaseline(job_id=job.job_id, reason=_too_short(levels)))
        else:
            usable.append((job, levels))
    kept, shifted = drop_before_shift(
        [lv for _, lv in usable],
        config.metrics,
        alpha=config.shift_alpha,
        min_effect=config.min_effect,
    )
    dropped += shifted
    used = [(job, lv) for job, lv in usable if lv.job_id in kept]
    base_levels = [lv for _, lv in used]

    tests: list[MetricTest] = []
    for metric in config.metrics:
        if metric in GOODPUT_METRICS:
            test = share_test(
                metric,
                [math.nan if c.goodput is None else c.goodput[metric] for c in candidates],
                [j.goodput[metric] for j, _ in used if j.goodput is not None],
            )
            if test is not None and len(test.base) == 0 and used:
                test = None  # no baseline has goodput: not measured, like a step metric
        else:
            test = MetricTest.of(metric, cand, base_levels)
        if test is None:
            notes.append(f"{metric}: not measured in the candidate or the baselines")
        else:
            tests.append(test)
    weighted_holm(tests, config)
    step_s = next((t for t in tests if t.metric == "step_s" and t.n), None)
    step_base_s = math.exp(step_s.base_mean) if step_s is not None else None
    verdicts = [
        decide_share(t, config)
        if t.metric in GOODPUT_METRICS
        else decide(t, config, step_base_s, too_short=bool(short))
        for t in tests
    ]
    if not verdicts:
        notes.append("no metric could be tested")

    attribution = None
    if step_base_s is not None:
        step = next(v for v in verdicts if v.metric == "step_s")
        min_growth = max(config.min_effect, 0.5 * max(step.slowdown or 0.0, 0.0))
        changes = component_changes(
            {t.metric: t.cand_log for t in tests},
            {t.metric: t.base_mean for t in tests if t.n},
            step_base_s,
        )
        grew = [c for c in changes if c.change_s > 0]
        attribution = Attribution(
            components=changes,
            cause=grew[0].metric if grew else None,
            ranks=rank_attribution(
                [j.ranks for j in candidates if j.ranks is not None],
                [j.ranks for j, _ in used if j.ranks is not None],
                min_growth=min_growth,
            ),
        )
    outcomes = {v.outcome for v in verdicts}
    outcome: Outcome = "pass"
    if "regression" in outcomes:
        outcome = "regression"
    elif "inconclusive" in outcomes or not verdicts:
        outcome = "inconclusive"
    return CheckResult(
        outcome=outcome,
        weak=any(v.weak for v in verdicts),
        candidates=[c.job_id for c in cand],
        baselines=[lv.job_id for lv in base_levels],
        dropped=dropped,
        metrics=verdicts,
        attribution=attribution,
        notes=notes,
        levels=[*cand, *base_levels],
        config=config,
    )


def _levels(job: JobData, config: CheckConfig) -> JobLevels:
    return job_levels(
        job.job_id, job_metrics(job.rollup), warmup_steps=config.warmup_steps, trim=config.trim
    )


def _too_short(levels: JobLevels) -> str:
    if not levels.num_steady_steps:
        return "no steps"
    return f"only {levels.num_steady_steps} steps after {levels.warmup_steps} warm-up steps"


def _finite(doc: Any) -> Any:
    """`doc` with non-finite floats as None (JSON has no NaN)."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [_finite(v) for v in doc]
    return doc
