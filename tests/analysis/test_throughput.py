"""Job throughput and MFU per step, and the findings drawn from them."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
import pytest

from stepscope import schema
from stepscope.analysis.stats.changepoints import ChangePointConfig
from stepscope.analysis.throughput.findings import job_series, mfu_per_step, throughput_findings

CONFIG = ChangePointConfig()
PEAK_FLOPS = 1e13
TOKENS_PER_RANK = 2048
FLOPS_PER_RANK = 1e12


def make_steps(
    step_s: np.ndarray,
    *,
    job_id: str = "job-1",
    with_tokens: bool = True,
    with_flops: bool = True,
) -> pl.DataFrame:
    """Canonical steps rows from a (num_ranks, num_steps) array of step times."""
    num_ranks, num_steps = step_s.shape
    rank = np.repeat(np.arange(num_ranks), num_steps)
    step = np.tile(np.arange(num_steps), num_ranks)
    columns: dict[str, Any] = {
        "job_id": [job_id] * rank.size,
        "rank": rank,
        "step": step,
        "ts": 1.7e9 + step * 0.5,
        "step_s": step_s.reshape(-1),
        "data_s": np.full(rank.size, 0.01),
    }
    if with_tokens:
        columns["tokens"] = np.full(rank.size, TOKENS_PER_RANK)
    if with_flops:
        columns["flops"] = np.full(rank.size, FLOPS_PER_RANK)
    assert set(columns) <= set(schema.STEPS.names)
    return pl.DataFrame(columns)


def noisy_step_s(num_ranks: int, num_steps: int, *, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.5 * (1.0 + 0.01 * rng.standard_normal((num_ranks, num_steps)))


def test_job_series_takes_the_slowest_rank_and_sums_the_work() -> None:
    step_s = np.array([[0.5, 0.4, 0.5], [0.6, 0.4, 0.25], [0.5, 0.8, 0.5]])
    steps = make_steps(step_s)

    series = job_series(steps)

    assert series["step"].to_list() == [0, 1, 2]
    assert series["num_ranks"].to_list() == [3, 3, 3]
    assert series["step_s"].to_list() == [0.6, 0.8, 0.5]
    assert series["tokens"].to_list() == [3 * TOKENS_PER_RANK] * 3
    assert series["flops"].to_list() == [3 * FLOPS_PER_RANK] * 3
    assert series["tokens_per_s"].to_list() == pytest.approx(
        [3 * TOKENS_PER_RANK / 0.6, 3 * TOKENS_PER_RANK / 0.8, 3 * TOKENS_PER_RANK / 0.5]
    )
    assert series["steps_per_s"].to_list() == pytest.approx([1 / 0.6, 1 / 0.8, 1 / 0.5])


def test_job_series_without_tokens_has_null_token_rates() -> None:
    steps = make_steps(np.full((2, 3), 0.25), with_tokens=False, with_flops=False)

    series = job_series(steps)

    assert series["tokens_per_s"].null_count() == 3
    assert series["flops"].null_count() == 3
    assert series["steps_per_s"].to_list() == [4.0, 4.0, 4.0]


def test_mfu_is_summed_flops_over_step_time_over_peak_of_all_ranks() -> None:
    step_s = np.array([[0.5, 0.25], [0.4, 1.0], [0.2, 0.5], [0.5, 0.5]])
    steps = make_steps(step_s)

    mfu = mfu_per_step(steps, PEAK_FLOPS)
    mfu_world = mfu_per_step(steps, PEAK_FLOPS, world_size=8)

    # step 0: 4e12 FLOP / 0.5 s / (1e13 FLOP/s × 4) = 0.2; step 1: 4e12 / 1.0 / 4e13 = 0.1
    assert mfu["step"].to_list() == [0, 1]
    assert mfu["mfu"].to_list() == pytest.approx([0.2, 0.1])
    assert mfu_world["mfu"].to_list() == pytest.approx([0.1, 0.05])


def test_mfu_of_a_partly_reported_step_counts_the_ranks_that_reported() -> None:
    steps = make_steps(np.full((4, 2), 0.5)).filter(~((pl.col("step") == 1) & (pl.col("rank") > 0)))

    mfu = mfu_per_step(steps, PEAK_FLOPS)

    assert mfu["mfu"].to_list() == pytest.approx([0.2, 0.2])


def test_mfu_without_peak_is_null_not_a_guess() -> None:
    mfu = mfu_per_step(make_steps(np.full((2, 3), 0.5)), None)

    assert mfu["mfu"].null_count() == 3


def test_throughput_drop_is_reported_with_its_step_size_and_severity() -> None:
    step_s = noisy_step_s(4, 400, seed=1)
    step_s[:, 250:] *= 1.25  # 20% fewer tokens/s from step 250
    job = {"job_id": "job-1", "peak_flops": PEAK_FLOPS, "device_name": "Test GPU"}

    findings = throughput_findings(make_steps(step_s), job=job, config=CONFIG)

    by_metric = {str(f.metric): f for f in findings}
    assert sorted(by_metric) == ["mfu", "tokens_per_s"]
    drop = by_metric["tokens_per_s"]
    assert (drop.kind, drop.severity, drop.job_id) == ("throughput_drop", "critical", "job-1")
    assert drop.first_step == pytest.approx(250, abs=2)
    assert drop.last_step == 399
    max_step_s = np.median(step_s[:, :250].max(axis=0))
    assert drop.expected == pytest.approx(4 * TOKENS_PER_RANK / max_step_s, rel=0.01)
    assert drop.observed == pytest.approx(4 * TOKENS_PER_RANK / max_step_s / 1.25, rel=0.015)
    assert drop.effect == pytest.approx(1 / 1.25 - 1, abs=0.01)
    assert drop.evidence["p_value"] < 1e-9
    assert drop.evidence["before_steps"] + drop.evidence["after_steps"] == 400 - 20
    mfu_drop = by_metric["mfu"]
    assert mfu_drop.kind == "throughput_drop"
    assert mfu_drop.expected == pytest.approx(
        4 * FLOPS_PER_RANK / max_step_s / (4 * PEAK_FLOPS), rel=0.01
    )
    assert mfu_drop.effect == pytest.approx(drop.effect, abs=0.005)


def test_small_drop_warns_and_gain_is_info() -> None:
    step_s = noisy_step_s(4, 600, seed=2)
    step_s[:, 200:400] *= 1.04  # 4% slower, then back
    job = {"job_id": "job-1", "peak_flops": PEAK_FLOPS}

    findings = throughput_findings(make_steps(step_s, with_flops=False), job=job, config=CONFIG)

    assert [(f.kind, f.severity, f.metric) for f in findings] == [
        ("throughput_drop", "warning", "tokens_per_s"),
        ("throughput_gain", "info", "tokens_per_s"),
    ]
    drop, gain = findings
    assert drop.first_step == pytest.approx(200, abs=3)
    assert gain.first_step == pytest.approx(400, abs=3)
    assert drop.last_step == (gain.first_step or 0) - 1
    assert drop.effect == pytest.approx(1 / 1.04 - 1, abs=0.006)
    assert gain.effect == pytest.approx(0.04, abs=0.006)


def test_clean_run_gives_no_findings() -> None:
    job = {"job_id": "job-1", "peak_flops": PEAK_FLOPS, "device_name": "Test GPU"}

    for seed in range(5):
        steps = make_steps(noisy_step_s(8, 500, seed=10 + seed))
        assert throughput_findings(steps, job=job, config=CONFIG) == []


def test_steps_without_a_job_id_column_take_it_from_the_job() -> None:
    step_s = noisy_step_s(4, 300, seed=12)
    step_s[:, 150:] *= 1.2
    steps = make_steps(step_s, with_flops=False).drop("job_id")

    (drop,) = throughput_findings(steps, job={"job_id": "j-7"}, config=CONFIG)

    assert (drop.job_id, drop.kind, drop.metric) == ("j-7", "throughput_drop", "tokens_per_s")
    with pytest.raises(ValueError, match="no job_id"):
        throughput_findings(steps, job=None, config=CONFIG)


def test_without_tokens_steps_per_s_is_analysed() -> None:
    step_s = noisy_step_s(2, 300, seed=3)
    step_s[:, 150:] *= 1.1

    (drop,) = throughput_findings(
        make_steps(step_s, with_tokens=False, with_flops=False), job=None, config=CONFIG
    )

    assert (drop.kind, drop.metric) == ("throughput_drop", "steps_per_s")
    assert drop.expected == pytest.approx(1 / np.median(step_s[:, :150].max(axis=0)), rel=0.01)


def test_peak_unknown_when_flops_but_no_peak_and_not_when_peak_given() -> None:
    steps = make_steps(noisy_step_s(2, 200, seed=4))
    job: dict[str, Any] = {"job_id": "job-1", "device_name": "Mystery Accelerator 9000"}

    (finding,) = throughput_findings(steps, job=job, config=CONFIG)

    assert (finding.kind, finding.severity, finding.metric) == ("peak_unknown", "warning", "mfu")
    assert finding.evidence["device_name"] == "Mystery Accelerator 9000"
    assert throughput_findings(steps, job={**job, "peak_flops": PEAK_FLOPS}, config=CONFIG) == []
    no_flops = make_steps(noisy_step_s(2, 200, seed=4), with_flops=False)
    assert throughput_findings(no_flops, job=job, config=CONFIG) == []


def test_peak_too_low_for_the_flops_is_reported_not_shown_as_over_100_percent() -> None:
    steps = make_steps(np.full((2, 100), 0.5))

    (finding,) = throughput_findings(
        steps, job={"job_id": "job-1", "peak_flops": 1e12}, config=CONFIG
    )

    assert finding.kind == "peak_unknown"
    assert "above 100%" in finding.evidence["reason"]
    assert finding.evidence["peak_flops"] == 1e12


def test_mfu_low_only_with_a_threshold() -> None:
    steps = make_steps(noisy_step_s(4, 200, seed=5))
    job = {"job_id": "job-1", "peak_flops": PEAK_FLOPS}

    assert throughput_findings(steps, job=job, config=CONFIG) == []
    (low,) = throughput_findings(steps, job=job, config=CONFIG, mfu_low_below=0.4)

    assert (low.kind, low.severity, low.metric, low.expected) == ("mfu_low", "warning", "mfu", 0.4)
    assert low.observed == pytest.approx(0.2, rel=0.03)
    assert low.effect == pytest.approx((low.observed or 0.0) / 0.4 - 1)


def test_steps_still_arriving_are_not_a_drop() -> None:
    step_s = noisy_step_s(4, 300, seed=6)
    # The last 30 steps: only rank 0 has reported, so the summed tokens are a quarter.
    steps = make_steps(step_s).filter((pl.col("step") < 270) | (pl.col("rank") == 0))

    assert throughput_findings(steps, job={"peak_flops": PEAK_FLOPS}, config=CONFIG) == []


def test_steps_of_several_jobs_are_refused() -> None:
    steps = pl.concat([make_steps(np.full((1, 50), 0.5), job_id=j) for j in ("a", "b")])

    with pytest.raises(ValueError, match="one job"):
        throughput_findings(steps, job=None, config=CONFIG)
