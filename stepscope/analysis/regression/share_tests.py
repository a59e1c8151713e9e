"""The regression gate's tests on shares of a job's GPU-time (goodput, badput_<category>).

A share is one number per job (docs/goodput.md), so it has no steady state and no within-job
noise: it is compared in absolute units (0.02 = 2 percentage points) against the baselines'
shares, by a one-sided prediction interval when there are enough baselines, and always with
the practical floor `min_effect`. The baselines' spread is at least SHARE_RESOLUTION_PP, the
accuracy goodput is measured to.
"""

from __future__ import annotations

import math

import numpy as np

from stepscope.analysis.regression.metric_tests import (
    CheckConfig,
    MetricTest,
    MetricVerdict,
    too_few_baselines,
    verdict_fields,
    verdict_with,
)
from stepscope.schema import GOODPUT_METRICS

SHARE_RESOLUTION = 0.005
"""The least spread of a share across jobs (goodput's ±0.5 pp accuracy goal)."""


def share_test(metric: str, candidates: list[float], baselines: list[float]) -> MetricTest | None:
    """The test of a share metric; None when the candidate runs lack it or every baseline
    does (a job without goodput)."""
    if metric not in GOODPUT_METRICS:
        raise ValueError(f"{metric} is not a share metric")
    if not candidates or any(not math.isfinite(c) for c in candidates):
        return None
    base = np.array([b for b in baselines if math.isfinite(b)], dtype=np.float64)
    test = MetricTest(
        metric=metric,
        sign=-1.0 if metric == "goodput" else 1.0,
        cand_log=float(np.mean(candidates)),  # the share itself: compared in absolute units
        cand_se=math.nan,
        m=len(candidates),
        base=base,
        base_se=SHARE_RESOLUTION,
    )
    if test.n:
        test.base_mean = float(base.mean())
        diff = test.sign * (test.cand_log - test.base_mean)
        sd = max(float(base.std(ddof=1)) if test.n > 1 else 0.0, SHARE_RESOLUTION)
        test.scale = sd * math.sqrt(1.0 / test.m + 1.0 / test.n)
        test.df = test.n - 1.0 if test.n > 1 else math.inf
        test.statistic = diff / test.scale
    return test


def decide_share(t: MetricTest, config: CheckConfig) -> MetricVerdict:
    """The verdict on a share metric: a regression when it is worse than the baselines by more
    than both their spread allows (at the metric's alpha) and min_effect."""
    cand = t.cand_log
    common = verdict_fields(t, cand, None)  # one number per job: no within-job noise
    if t.n == 0:
        return verdict_with(common, "inconclusive", "no baseline job to compare with")
    worse = t.sign * (cand - t.base_mean)
    floor = config.min_effect
    bound = t.bound(t.alpha) if t.n > 1 else 0.0
    common |= {
        "baseline": t.base_mean,
        "baseline_min": float(t.base.min()),
        "baseline_max": float(t.base.max()),
        "effect": cand - t.base_mean,
        "slowdown": worse,
        "limit": t.base_mean + t.sign * max(bound, floor),
        "p_value": t.p_worse() if t.n > 1 else None,
        "baseline_sd": float(t.base.std(ddof=1)) if t.n > 1 else None,
    }
    what = (
        f"{100 * (cand - t.base_mean):+.2f} pp of the GPU-time "
        f"({'worse' if worse > 0 else 'better' if worse < 0 else 'the same'})"
    )
    floor_text = f"the {100 * floor:g} pp floor"
    if t.n == 1:
        regressed = worse >= floor
        reason = f"weak: one baseline job; {what}" + (
            f", beyond {floor_text}" if regressed else f", within {floor_text}"
        )
        return verdict_with(
            common,
            "regression" if regressed else "pass",
            reason,
            weak=True,
            improved=-worse >= floor,
        )
    too_few = too_few_baselines(t, config, common)
    if too_few is not None:
        return too_few
    beyond = f"p = {t.p_worse():.2g} at alpha {t.alpha:.2g}"
    if t.rejected and worse >= floor:
        return verdict_with(common, "regression", f"{what}: beyond the baselines' range ({beyond})")
    improved = -worse >= max(floor, bound)
    if t.rejected:
        reason = f"{what}: significant ({beyond}) but below {floor_text}"
        return verdict_with(common, "pass", reason)
    return verdict_with(
        common, "pass", f"{what}: within the baselines' range ({beyond})", improved=improved
    )
