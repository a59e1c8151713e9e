"""Per-metric tests of the regression gate: prediction intervals, the correction, verdicts.

Levels are compared "worse-positive": in log units, sign-flipped for higher-is-better
metrics, so a positive difference always means slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Literal

import numpy as np

from stepscope.analysis.frames.steady import (
    COMPONENTS,
    HIGHER_IS_BETTER,
    METRICS,
    THROUGHPUT,
    JobLevels,
)
from stepscope.analysis.stats.student_t import t_ppf, t_sf
from stepscope.schema import GOODPUT_METRICS

Outcome = Literal["pass", "regression", "inconclusive"]
ALL_METRICS = (*METRICS, *GOODPUT_METRICS)
"""Every metric the gate can test; the goodput shares only when asked for."""
Floats = np.ndarray[Any, np.dtype[np.float64]]


@dataclass(kw_only=True, slots=True)
class CheckConfig:
    metrics: tuple[str, ...] = METRICS
    """Metrics tested (stepscope.analysis.frames.steady.METRICS, and the shares of
    stepscope.schema.GOODPUT_METRICS when asked for)."""
    alpha: float = 0.01
    """Family-wise false-fail rate over all metrics tested."""
    min_effect: float = 0.02
    """Smallest slowdown that fails: 0.02 = 2% (components: 2% of the step time)."""
    warmup_steps: int | None = None
    """Leading steps of each job ignored; None: found from each job's step times."""
    min_steady_steps: int = 20
    """Fewest steps after warm-up that summarise a job."""
    trim: float = 0.1
    """Share of steady steps trimmed at each end before the mean (spikes, stalls)."""
    throughput_share: float = 0.8
    """Share of alpha held by the step-time hypotheses; the components share the rest."""
    max_t_inflation: float = 2.0
    """Fewest baselines: those whose t quantile is at most this times the normal one."""
    noise_ratio: float = 3.0
    """A candidate whose standard error exceeds the baselines' this many times is noisy."""
    shift_alpha: float = 0.001
    """Significance of a level shift in the baselines' history."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.metrics if m not in ALL_METRICS]
        if unknown or not self.metrics:
            raise ValueError(f"metrics must be among {', '.join(ALL_METRICS)}; got {unknown}")
        if not 0 < self.alpha < 0.5:
            raise ValueError("alpha must be in (0, 0.5)")
        if not 0 <= self.min_effect < 1:
            raise ValueError("min_effect must be in [0, 1)")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if not 0 < self.throughput_share < 1 or not 0 <= self.trim < 0.5:
            raise ValueError("throughput_share must be in (0, 1), trim in [0, 0.5)")
        if self.min_steady_steps < 4 or self.max_t_inflation <= 1 or self.noise_ratio <= 1:
            raise ValueError("need min_steady_steps >= 4, max_t_inflation > 1, noise_ratio > 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricVerdict:
    """The verdict on one metric, with the numbers behind it."""

    metric: str
    higher_is_better: bool
    outcome: Outcome
    weak: bool
    """Decided from one baseline's steps: run-to-run noise is unknown."""
    improved: bool
    candidate: float
    baseline: float | None
    """Geometric mean of the baselines' levels."""
    baseline_min: float | None
    baseline_max: float | None
    effect: float | None
    """candidate / baseline − 1, signed."""
    slowdown: float | None
    """How much slower, signed (lower-is-better: the effect; rates: baseline / candidate − 1)."""
    step_share: float | None
    """Components: the change as a share of the baselines' step time."""
    limit: float | None
    """Candidate values beyond this are a regression (the interval and the floor)."""
    p_value: float | None
    """One-sided, of a slowdown at least this large under no change."""
    alpha: float
    """The level this metric was tested at, after the correction."""
    num_baselines: int
    min_baselines: int | None
    """Fewest baselines the test needs at its level."""
    candidate_se: float | None
    """Relative standard error of the candidate's level from its own steps."""
    baseline_sd: float | None
    """Relative spread of the baselines' levels."""
    reason: str


@dataclass(kw_only=True, slots=True)
class MetricTest:
    """One metric's levels and its test statistic."""

    metric: str
    sign: float
    """+1 lower is better, −1 higher is better."""
    cand_log: float
    """Mean over the candidate runs of their levels."""
    cand_se: float
    """Standard error of cand_log from the runs' own steps."""
    m: int
    base: Floats
    base_se: float
    """Typical (median) standard error of one baseline's level."""
    base_mean: float = math.nan
    scale: float = math.nan
    """Standard deviation of cand_log − base_mean (log units)."""
    statistic: float = math.nan
    """Worse-positive (cand_log − base_mean) / scale."""
    df: float = math.nan
    weight: float = 0.0
    alpha: float = 0.0
    rejected: bool = False

    @property
    def n(self) -> int:
        return int(self.base.size)

    @classmethod
    def of(cls, metric: str, cand: list[JobLevels], base: list[JobLevels]) -> MetricTest | None:
        """The test of `metric`; None if the candidate runs or all baselines lack it."""
        cand_levels = [c.levels[metric] for c in cand if metric in c.levels]
        base_levels = [b.levels[metric] for b in base if metric in b.levels]
        if len(cand_levels) < len(cand) or (base and not base_levels):
            return None
        run_se = np.array([lv.se_log for lv in cand_levels])
        base_se = np.array([lv.se_log for lv in base_levels])
        test = cls(
            metric=metric,
            sign=-1.0 if metric in HIGHER_IS_BETTER else 1.0,
            cand_log=float(np.mean([lv.log_value for lv in cand_levels])),
            cand_se=math.sqrt(float(np.mean(run_se**2)) / run_se.size)
            if np.isfinite(run_se).all()
            else math.nan,
            m=len(cand_levels),
            base=np.array([lv.log_value for lv in base_levels]),
            base_se=float(np.median(base_se[np.isfinite(base_se)]))
            if np.isfinite(base_se).any()
            else math.nan,
        )
        test._setup()
        return test

    def _setup(self) -> None:
        if self.n == 0:
            return
        self.base_mean = float(self.base.mean())
        diff = self.sign * (self.cand_log - self.base_mean)
        if self.n == 1:
            self.scale = math.hypot(_or0(self.cand_se), _or0(self.base_se))
            self.df = math.inf
        else:
            # The spread of the baselines' levels is at least their own sampling noise.
            sd = max(float(self.base.std(ddof=1)), _or0(self.base_se))
            self.scale = math.sqrt((sd * sd + self.excess_variance) / self.m + sd * sd / self.n)
            self.df = self.n - 1.0
        self.statistic = diff / self.scale if self.scale > 0 else math.copysign(math.inf, diff)

    @property
    def excess_variance(self) -> float:
        """How much more variance one candidate run's level has than a baseline's."""
        if not (math.isfinite(self.cand_se) and math.isfinite(self.base_se)):
            return 0.0
        return max(0.0, self.m * self.cand_se**2 - self.base_se**2)

    def p_worse(self) -> float:
        return t_sf(self.statistic, self.df)

    def bound(self, alpha: float) -> float:
        """The worse-positive log difference beyond which the test rejects at `alpha`."""
        return t_ppf(1.0 - alpha, self.df) * self.scale


def weighted_holm(tests: list[MetricTest], config: CheckConfig) -> None:
    """Set each test's weight, level and rejection: weighted Holm over distinct hypotheses."""
    groups: list[list[MetricTest]] = []
    for t in tests:
        same = next((g for g in groups if _same_hypothesis(g[0], t)), None)
        if same is None:
            groups.append([t])
        else:
            same.append(t)
    primary = [any(t.metric in THROUGHPUT for t in g) for g in groups]
    num_primary = sum(primary)
    share = config.throughput_share if 0 < num_primary < len(groups) else float(num_primary > 0)
    weight = [
        share / num_primary if is_primary else (1.0 - share) / (len(groups) - num_primary)
        for is_primary in primary
    ]
    for g, w in zip(groups, weight, strict=True):
        for t in g:
            t.weight, t.alpha = w, config.alpha * w
    remaining = [i for i, g in enumerate(groups) if g[0].n >= 2]
    while remaining:
        total = sum(weight[i] for i in remaining)
        for i in remaining:
            for t in groups[i]:
                t.alpha = config.alpha * weight[i] / total
        best = min(remaining, key=lambda i: groups[i][0].p_worse() / weight[i])
        if groups[best][0].p_worse() > groups[best][0].alpha:
            return
        for t in groups[best]:
            t.rejected = True
        remaining.remove(best)


def _same_hypothesis(a: MetricTest, b: MetricTest) -> bool:
    """Whether two tests are one hypothesis in other units (equal statistics)."""
    return (
        a.n == b.n
        and a.n > 0
        and math.isclose(a.statistic, b.statistic, rel_tol=1e-9, abs_tol=1e-12)
    )


def min_baselines(alpha: float, max_t_inflation: float) -> int:
    """Fewest baselines whose t quantile at `alpha` is within max_t_inflation × the normal's."""
    limit = max_t_inflation * NormalDist().inv_cdf(1.0 - alpha)
    n = 2
    while t_ppf(1.0 - alpha, n - 1) > limit:
        n += 1
    return n


def too_few_baselines(
    t: MetricTest, config: CheckConfig, common: dict[str, Any]
) -> MetricVerdict | None:
    """An inconclusive verdict when `t` has fewer baselines than its alpha needs (and the
    fewest it needs in `common`), else None."""
    needed = min_baselines(config.alpha, config.max_t_inflation)
    common["min_baselines"] = needed
    if t.n >= needed:
        return None
    reason = f"{t.n} baseline jobs; at alpha {config.alpha:g} the check needs {needed}"
    return verdict_with(common, "inconclusive", reason)


def decide(
    t: MetricTest, config: CheckConfig, step_s: float | None, *, too_short: bool
) -> MetricVerdict:
    """The verdict on a tested metric; step_s is the baselines' step time (components' floor)."""
    cand = math.exp(t.cand_log)
    component = t.metric in COMPONENTS and step_s is not None
    common = verdict_fields(t, cand, math.expm1(t.cand_se) if math.isfinite(t.cand_se) else None)
    if t.n == 0:
        return verdict_with(common, "inconclusive", "no baseline job to compare with")
    base = math.exp(t.base_mean)
    worse = t.sign * (t.cand_log - t.base_mean)
    step_share = (cand - base) / step_s if component and step_s else None
    floor_log = (
        math.log1p(config.min_effect * step_s / base)
        if component and step_s
        else math.log1p(config.min_effect)
    )
    stat_bound = t.bound(t.alpha)
    limit_log = t.base_mean + t.sign * max(stat_bound, floor_log)
    p_value = t.p_worse()
    common |= {
        "baseline": base,
        "baseline_min": math.exp(float(t.base.min())),
        "baseline_max": math.exp(float(t.base.max())),
        "effect": cand / base - 1.0,
        "slowdown": math.expm1(worse),
        "step_share": step_share,
        "limit": math.exp(limit_log),
        "p_value": p_value,
        "baseline_sd": math.expm1(float(t.base.std(ddof=1))) if t.n > 1 else None,
    }
    what = f"{math.expm1(worse):+.1%} {'slower' if worse >= 0 else 'faster'}"
    if step_share is not None:
        what += f" ({step_share:+.1%} of the step time)"
    floor = f"the {config.min_effect:.0%} floor" + (" of the step time" if component else "")
    if too_short:
        return verdict_with(common, "inconclusive", "the candidate has too few steady-state steps")
    if t.n == 1:
        significant = p_value <= t.alpha and worse >= floor_log
        reason = f"weak: one baseline job, steady-state steps compared; {what}" + (
            f", beyond its noise and {floor}" if significant else ", within noise or floor"
        )
        improved = 1.0 - p_value <= t.alpha and -worse >= floor_log
        return verdict_with(
            common, "regression" if significant else "pass", reason, weak=True, improved=improved
        )
    too_few = too_few_baselines(t, config, common)
    if too_few is not None:
        return too_few
    beyond = f"p = {p_value:.2g} at alpha {t.alpha:.2g}"
    if t.rejected and worse >= floor_log:
        return verdict_with(common, "regression", f"{what}: beyond the baselines' range ({beyond})")
    noisy = (
        math.isfinite(t.cand_se)
        and math.isfinite(t.base_se)
        and t.cand_se > config.noise_ratio * t.base_se
        and t.cand_se > 0.25 * math.log1p(config.min_effect)
    )
    if noisy:
        reason = (
            f"the candidate's own steps are too noisy: its level is known to "
            f"±{math.expm1(t.cand_se):.1%}, a baseline's to ±{math.expm1(t.base_se):.1%}"
        )
        return verdict_with(common, "inconclusive", reason)
    improved = t_sf(-t.statistic, t.df) <= t.alpha and -worse >= floor_log
    if t.rejected:
        reason = f"{what}: significant ({beyond}) but below {floor}"
    else:
        reason = f"{what}: within the baselines' range ({beyond})"
    return verdict_with(common, "pass", reason, improved=improved)


def verdict_fields(t: MetricTest, candidate: float, candidate_se: float | None) -> dict[str, Any]:
    """The fields every verdict on `t` carries, whatever it decides."""
    return {
        "metric": t.metric,
        "higher_is_better": t.sign < 0,
        "candidate": candidate,
        "num_baselines": t.n,
        "alpha": t.alpha,
        "candidate_se": candidate_se,
    }


def verdict_with(
    common: dict[str, Any],
    outcome: Outcome,
    reason: str,
    *,
    weak: bool = False,
    improved: bool = False,
) -> MetricVerdict:
    """A verdict from the numbers in `common`; the ones it lacks are None."""
    defaults: dict[str, Any] = dict.fromkeys(
        (
            "baseline",
            "baseline_min",
            "baseline_max",
            "effect",
            "slowdown",
            "step_share",
            "limit",
            "p_value",
            "baseline_sd",
            "min_baselines",
        ),
    )
    return MetricVerdict(
        **(defaults | common), outcome=outcome, reason=reason, weak=weak, improved=improved
    )


def _or0(x: float) -> float:
    return x if math.isfinite(x) else 0.0
