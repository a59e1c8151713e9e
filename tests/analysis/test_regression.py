"""The regression gate's statistics on synthetic jobs (synthetic.generate), values asserted."""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import polars as pl
import pytest

from stepscope.analysis.frames.steady import detect_warmup, job_levels, job_metrics, trimmed_mean
from stepscope.analysis.regression.baselines import last_shift
from stepscope.analysis.regression.gate import (
    CheckConfig,
    JobData,
    check_regression,
    job_from_steps,
)
from stepscope.analysis.regression.metric_tests import min_baselines
from stepscope.analysis.stats.student_t import t_ppf, t_sf
from stepscope.synthetic.generate import JobSpec, SlowNode, Straggler, generate, to_frames

NUM_RANKS = 8
BASE_STEP_S = 0.5
PEAK_FLOPS = 9.89e14


def steps_of(seed: int, **spec: object) -> pl.DataFrame:
    """Canonical steps of a 200-step, 8-rank synthetic job."""
    defaults: dict[str, object] = {
        "job_id": f"job-{seed}",
        "num_ranks": NUM_RANKS,
        "ranks_per_node": 4,
        "num_steps": 200,
        "base_step_s": BASE_STEP_S,
        "seed": seed,
        "start_ts": 1.7e9 + 3600 * seed,
        "with_gpu": False,
        "with_collectives": False,
    }
    return to_frames(generate(JobSpec(**{**defaults, **spec})))["steps"]  # type: ignore[arg-type]


def data_of(steps: pl.DataFrame) -> JobData:
    return job_from_steps(steps, peak_flops=PEAK_FLOPS)


@cache
def job(seed: int) -> JobData:
    return data_of(steps_of(seed))


def baselines(count: int = 10) -> list[JobData]:
    return [job(s) for s in range(count)]


def slowed(seed: int, cause: str, share: float, ranks: tuple[int, ...] | None = None) -> JobData:
    """A job whose `cause` takes `share` of the clean step time longer on these ranks (all)."""
    straggler = Straggler(
        ranks=ranks or tuple(range(NUM_RANKS)),
        factor=1.0 + share,
        cause=cause,  # type: ignore[arg-type]
        from_step=0,
    )
    return data_of(steps_of(seed, stragglers=(straggler,)))


def test_t_distribution_matches_published_quantiles() -> None:
    assert t_ppf(0.99, 9) == pytest.approx(2.821438, abs=1e-6)
    assert t_ppf(0.975, 1) == pytest.approx(12.706205, abs=1e-6)
    assert t_ppf(0.995, 30) == pytest.approx(2.749996, abs=1e-6)
    assert t_sf(2.0, 10) == pytest.approx(0.036694, abs=1e-6)
    assert t_sf(-1.0, 5) == pytest.approx(1.0 - 0.181609, abs=1e-6)
    assert t_ppf(0.999, math.inf) == pytest.approx(3.090232, abs=1e-6)


def test_warmup_is_found_from_the_series_itself() -> None:
    metrics = job_metrics(job(0).rollup)
    warmup = detect_warmup(metrics["step_s"].to_numpy())
    # synth's warm-up: 10 steps from 5x down to the steady level
    assert 10 <= warmup <= 40
    flat = np.full(200, 0.5) * (1 + 0.01 * np.random.default_rng(0).standard_normal(200))
    assert detect_warmup(flat) <= 20


def test_a_job_level_is_the_log_of_a_trimmed_mean_and_ignores_spikes() -> None:
    metrics = job_metrics(job(0).rollup)
    levels = job_levels("job-0", metrics, warmup_steps=50)
    steady = metrics["step_s"].to_numpy()[50:]
    assert levels.levels["step_s"].log_value == pytest.approx(math.log(trimmed_mean(steady, 0.1)))
    spiked = metrics.with_columns(
        pl.when(pl.col("step") % 37 == 0).then(pl.col("step_s") * 3).otherwise(pl.col("step_s"))
    )
    spiky = job_levels("job-0", spiked, warmup_steps=50).levels["step_s"]
    assert spiky.value == pytest.approx(levels.levels["step_s"].value, rel=0.003)
    # tokens/s is tokens per step over step time: the same hypothesis in other units
    assert levels.levels["tokens_per_s"].log_value == pytest.approx(
        math.log(NUM_RANKS * 16384) - levels.levels["step_s"].log_value
    )


def test_an_unchanged_job_passes_on_every_metric() -> None:
    result = check_regression([job(100)], baselines(), CheckConfig())
    assert result.outcome == "pass"
    assert not result.weak
    assert [v.metric for v in result.metrics] == [
        "step_s",
        "tokens_per_s",
        "mfu",
        "data_s",
        "compute_s",
        "comm_wait_s",
    ]
    for v in result.metrics:
        assert v.outcome == "pass", v
        assert v.num_baselines == 10
        assert abs(v.slowdown or 0.0) < 0.01
    assert result.baselines == [f"job-{s}" for s in range(10)]
    assert result.dropped == []


def test_a_compute_regression_fails_step_time_and_is_attributed_to_compute() -> None:
    result = check_regression([slowed(101, "compute", 0.05)], baselines(), CheckConfig())
    assert result.outcome == "regression"
    step = result.verdict("step_s")
    assert step is not None
    assert step.outcome == "regression"
    assert step.slowdown == pytest.approx(0.05, abs=0.01)
    assert step.limit is not None
    assert step.baseline is not None
    assert step.baseline < step.limit < step.candidate
    assert step.p_value is not None
    assert step.p_value < step.alpha
    tokens = result.verdict("tokens_per_s")
    assert tokens is not None
    assert tokens.outcome == "regression"
    assert tokens.effect == pytest.approx(1 / (1 + step.slowdown) - 1, rel=1e-6)
    assert result.verdict("compute_s").outcome == "regression"  # type: ignore[union-attr]
    assert result.verdict("data_s").outcome == "pass"  # type: ignore[union-attr]
    assert result.attribution is not None
    assert result.attribution.cause == "compute_s"
    shares = {c.metric: c.share for c in result.attribution.components}
    assert shares["compute_s"] > 0.9
    assert result.attribution.ranks is not None
    assert result.attribution.ranks.scope == "spread"
    assert result.attribution.ranks.typical_growth == pytest.approx(0.05, abs=0.015)


@pytest.mark.parametrize(
    ("cause", "metric"), [("data", "data_s"), ("communication", "comm_wait_s")]
)
def test_data_and_communication_regressions_name_their_component(cause: str, metric: str) -> None:
    result = check_regression([slowed(102, cause, 0.05)], baselines(), CheckConfig())
    assert result.outcome == "regression"
    assert result.verdict("step_s").outcome == "regression"  # type: ignore[union-attr]
    assert result.verdict(metric).outcome == "regression"  # type: ignore[union-attr]
    assert result.verdict("compute_s").outcome == "pass"  # type: ignore[union-attr]
    assert result.attribution is not None
    assert result.attribution.cause == metric
    component = next(c for c in result.attribution.components if c.metric == metric)
    assert component.change_s == pytest.approx(0.05 * BASE_STEP_S, rel=0.15)
    assert component.step_share == pytest.approx(0.05, abs=0.01)


def test_a_new_straggler_is_named_by_rank_and_its_component() -> None:
    result = check_regression(
        [slowed(103, "compute", 0.10, ranks=(5,))], baselines(), CheckConfig()
    )
    assert result.outcome == "regression"
    assert result.attribution is not None
    # on the critical path the job waits for rank 5's compute, not for communication
    assert result.attribution.cause == "compute_s"
    ranks = result.attribution.ranks
    assert ranks is not None
    assert ranks.scope == "ranks"
    assert [(c.rank, c.node, c.component) for c in ranks.ranks] == [(5, "node-0001", "compute_s")]
    assert ranks.ranks[0].growth == pytest.approx(0.10 * BASE_STEP_S / 0.49, rel=0.2)
    assert abs(ranks.typical_growth) < 0.01


def test_a_slow_node_is_named() -> None:
    steps = steps_of(
        104,
        slow_nodes=(SlowNode(node=1, factor=1.1, cause="data", from_step=0),),
        num_ranks=16,
    )
    history = [data_of(steps_of(s, num_ranks=16)) for s in range(10)]
    result = check_regression([data_of(steps)], history, CheckConfig())
    assert result.outcome == "regression"
    assert result.attribution is not None
    assert result.attribution.cause == "data_s"
    ranks = result.attribution.ranks
    assert ranks is not None
    assert ranks.scope == "node"
    assert ranks.nodes == ["node-0001"]
    assert sorted(c.rank for c in ranks.ranks) == [4, 5, 6, 7]
    assert {c.component for c in ranks.ranks} == {"data_s"}


def test_too_few_baselines_for_the_alpha_is_inconclusive() -> None:
    assert min_baselines(0.01, 2.0) == 4
    result = check_regression([slowed(105, "compute", 0.05)], baselines(3), CheckConfig())
    assert result.outcome == "inconclusive"
    assert result.baseline_missing
    step = result.verdict("step_s")
    assert step is not None
    assert step.min_baselines == 4
    assert step.num_baselines == 3
    assert "3 baseline jobs" in step.reason
    assert "needs 4" in step.reason
    none = check_regression([job(100)], [], CheckConfig())
    assert none.outcome == "inconclusive"
    assert none.baseline_missing
    assert all(v.reason == "no baseline job to compare with" for v in none.metrics)


def test_one_baseline_gives_a_weak_verdict_with_the_effect_floor() -> None:
    slow = check_regression([slowed(106, "compute", 0.05)], baselines(1), CheckConfig())
    assert slow.outcome == "regression"
    assert slow.weak
    step = slow.verdict("step_s")
    assert step is not None
    assert step.weak
    assert step.outcome == "regression"
    assert step.reason.startswith("weak: one baseline job")
    same = check_regression([job(100)], baselines(1), CheckConfig())
    assert same.outcome == "pass"
    assert same.weak
    # 1% slower is measurable within the jobs, but below the 2% floor
    small = check_regression([slowed(107, "compute", 0.01)], baselines(1), CheckConfig())
    assert small.outcome == "pass"


def test_improvements_are_reported_and_never_fail() -> None:
    steps = steps_of(108).with_columns(pl.col("step_s", "data_s", "comm_wait_s") * 0.9)
    result = check_regression([data_of(steps)], baselines(), CheckConfig())
    assert result.outcome == "pass"
    step = result.verdict("step_s")
    assert step is not None
    assert step.improved
    assert step.effect == pytest.approx(-0.1, abs=0.01)
    assert result.verdict("tokens_per_s").improved  # type: ignore[union-attr]


def test_a_significant_change_below_the_floor_passes() -> None:
    result = check_regression([slowed(109, "compute", 0.01)], baselines(), CheckConfig())
    step = result.verdict("step_s")
    assert step is not None
    assert step.outcome == "pass"
    assert step.p_value is not None
    assert step.p_value < step.alpha
    assert "below the 2% floor" in step.reason
    strict = check_regression(
        [slowed(109, "compute", 0.01)], baselines(), CheckConfig(min_effect=0.005)
    )
    assert strict.verdict("step_s").outcome == "regression"  # type: ignore[union-attr]


def test_a_candidate_much_noisier_than_its_baselines_is_inconclusive() -> None:
    # The step time swings ±8% in blocks of 10 steps: the level holds, its error is large.
    swings = np.random.default_rng(3).permutation([1.08] * 10 + [0.92] * 10)
    steps = steps_of(110)
    factor = swings[steps["step"].to_numpy() // 10]
    noisy = data_of(steps.with_columns(pl.col("step_s") * factor))
    result = check_regression([noisy], baselines(), CheckConfig(metrics=("step_s",)))
    step = result.verdict("step_s")
    assert step is not None
    assert step.outcome == "inconclusive"
    assert "too noisy" in step.reason
    assert step.candidate_se is not None
    assert step.candidate_se > 0.005
    assert not result.baseline_missing


def test_baselines_before_a_level_shift_are_dropped_and_named() -> None:
    history = [
        data_of(steps_of(s).with_columns(pl.col("step_s", "data_s", "comm_wait_s") * 1.1))
        if s < 4
        else job(s)
        for s in range(10)
    ]
    result = check_regression([job(100)], history, CheckConfig())
    assert [d.job_id for d in result.dropped] == ["job-0", "job-1", "job-2", "job-3"]
    assert "shift of step_s at job-4" in result.dropped[0].reason
    assert result.baselines == [f"job-{s}" for s in range(4, 10)]
    assert result.outcome == "pass"
    assert last_shift(np.zeros(10), alpha=0.01, min_effect=0.02) is None


def test_a_component_shift_drops_baselines_only_when_it_matters_to_the_step_time() -> None:
    # data_s is ~2% of the step: +10% of it is 0.2% of the step (the verdict's floor is 2% of
    # the step time), +200% is ~4%.
    def history(data_factor: float) -> list[JobData]:
        return [
            data_of(steps_of(s).with_columns(pl.col("data_s") * data_factor)) if s < 4 else job(s)
            for s in range(10)
        ]

    small = check_regression([job(100)], history(1.1), CheckConfig())
    assert small.dropped == []
    assert small.baselines == [f"job-{s}" for s in range(10)]
    large = check_regression([job(100)], history(3.0), CheckConfig())
    assert [d.job_id for d in large.dropped] == ["job-0", "job-1", "job-2", "job-3"]
    assert "shift of data_s at job-4" in large.dropped[0].reason


def test_alpha_is_shared_by_distinct_hypotheses_by_weighted_holm() -> None:
    result = check_regression([job(100)], baselines(), CheckConfig(alpha=0.01))
    by_metric = {v.metric: v.alpha for v in result.metrics}
    # step_s, tokens_per_s and mfu are one hypothesis holding 80% of alpha; the components
    # share the rest; nothing rejected, so nothing passed on
    assert by_metric["step_s"] == by_metric["tokens_per_s"] == by_metric["mfu"]
    assert by_metric["step_s"] == pytest.approx(0.008)
    assert by_metric["data_s"] == pytest.approx(0.002 / 3)
    only = check_regression([job(100)], baselines(), CheckConfig(metrics=("data_s",)))
    assert only.metrics[0].alpha == pytest.approx(0.01)


def test_reruns_of_the_candidate_are_averaged() -> None:
    runs = [slowed(111, "compute", 0.03), slowed(112, "compute", 0.03)]
    result = check_regression(runs, baselines(), CheckConfig())
    assert result.candidates == ["job-111", "job-112"]
    assert result.outcome == "regression"
    step = result.verdict("step_s")
    assert step is not None
    one = check_regression(runs[:1], baselines(), CheckConfig()).verdict("step_s")
    two = check_regression(runs[1:], baselines(), CheckConfig()).verdict("step_s")
    assert one is not None
    assert two is not None
    assert step.candidate == pytest.approx(math.sqrt(one.candidate * two.candidate))


def test_the_result_is_json_ready() -> None:
    doc = check_regression([job(100)], baselines(1), CheckConfig()).to_dict()
    assert doc["outcome"] == "pass"
    assert doc["weak"] is True
    assert doc["metrics"][0]["baseline_sd"] is None
    assert doc["levels"][0]["job_id"] == "job-100"
    assert doc["config"]["alpha"] == 0.01


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="metrics"):
        CheckConfig(metrics=("step_time",))
    with pytest.raises(ValueError, match="alpha"):
        CheckConfig(alpha=0.7)
