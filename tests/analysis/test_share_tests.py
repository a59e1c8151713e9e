"""The gate's tests on goodput shares: floors, one baseline, too few, a share in pp."""

from __future__ import annotations

import math

import pytest

from stepscope.analysis.regression.metric_tests import CheckConfig, weighted_holm
from stepscope.analysis.regression.share_tests import SHARE_RESOLUTION, decide_share, share_test
from stepscope.analysis.stats.student_t import t_ppf


def _verdict(metric: str, cand: float, base: list[float], min_effect: float = 0.02):  # noqa: ANN202
    config = CheckConfig(metrics=(metric,), min_effect=min_effect)
    test = share_test(metric, [cand], base)
    assert test is not None
    weighted_holm([test], config)
    return decide_share(test, config)


def test_one_baseline_fails_beyond_the_floor_only_and_is_weak() -> None:
    worse = _verdict("goodput", 0.90, [0.93])
    assert (worse.outcome, worse.weak) == ("regression", True)
    assert worse.limit == pytest.approx(0.91)
    assert worse.effect == pytest.approx(-0.03)
    within = _verdict("goodput", 0.915, [0.93])
    assert within.outcome == "pass"
    better = _verdict("badput_hang", 0.0, [0.05])
    assert (better.outcome, better.improved) == ("pass", True)


def test_the_prediction_interval_widens_the_limit_beyond_the_floor() -> None:
    base = [0.80, 0.90, 0.85, 0.95, 0.88]
    v = _verdict("goodput", 0.80, base)
    mean = sum(base) / len(base)
    assert v.baseline == pytest.approx(mean)
    assert v.limit is not None
    assert mean - v.limit > 0.02  # the spread, not the floor, sets the limit
    assert v.outcome == "pass"
    tight = _verdict("badput_restart_downtime", 0.10, [0.0] * 5)
    assert tight.outcome == "regression"
    assert tight.baseline_sd == 0.0
    assert tight.limit is not None
    # Identical baselines: their spread is the resolution, the interval at alpha 0.01.
    bound = t_ppf(1 - 0.01, 4) * SHARE_RESOLUTION * math.sqrt(1 + 1 / 5)
    assert tight.limit == pytest.approx(max(bound, 0.02))
    assert _verdict("badput_restart_downtime", 0.10, [0.0] * 5, min_effect=0.05).limit == 0.05


def test_too_few_baselines_is_inconclusive_and_a_missing_candidate_untested() -> None:
    assert _verdict("goodput", 0.5, [0.9, 0.91]).outcome == "inconclusive"
    assert share_test("goodput", [float("nan")], [0.9]) is None
    with pytest.raises(ValueError, match="not a share metric"):
        share_test("step_s", [1.0], [1.0])
