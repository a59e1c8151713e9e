"""Job-level findings: dataloader_stall and slow_collective."""

from __future__ import annotations

import polars as pl
import pytest

from stepscope.analysis import AnalysisConfig, analyze
from stepscope.schema import Finding
from stepscope.synthetic.generate import JobSpec, generate, to_frames


def _kind(findings: list[Finding], kind: str) -> list[Finding]:
    return [f for f in findings if f.kind == kind]


def test_data_bound_job_is_a_dataloader_stall() -> None:
    frames = to_frames(generate(JobSpec(num_ranks=16, num_steps=400, data_share=0.2)))
    (f,) = _kind(analyze(frames["steps"]), "dataloader_stall")
    assert (f.ranks, f.cause, f.metric, f.last_step) == ([], "data", "data_share", None)
    assert f.first_step == 20
    assert f.observed == pytest.approx(0.2, abs=0.02)
    assert f.expected == 0.10
    assert f.effect == pytest.approx(1.0, abs=0.2)
    assert f.severity == "warning"


def test_job_stall_from_a_later_step_has_its_onset() -> None:
    frames = to_frames(generate(JobSpec(num_ranks=16, num_steps=600, seed=2)))
    steps = (
        frames["steps"]
        .with_columns(
            pl.when(pl.col("step") >= 300)
            .then(pl.col("data_s") + 0.2)
            .otherwise(pl.col("data_s"))
            .alias("data_s"),
        )
        .with_columns(
            pl.when(pl.col("step") >= 300)
            .then(pl.col("step_s") + 0.2)
            .otherwise(pl.col("step_s"))
            .alias("step_s")
        )
    )
    (f,) = _kind(analyze(steps), "dataloader_stall")
    assert f.first_step == pytest.approx(300, abs=2)
    assert f.observed == pytest.approx(0.21 / 0.7, abs=0.03)
    assert f.severity == "critical"


def test_ranks_stalling_intermittently_are_named() -> None:
    frames = to_frames(generate(JobSpec(num_ranks=16, num_steps=400, seed=4)))
    stalls = (pl.col("rank").is_in([3, 11])) & (pl.col("step") % 2 == 0)
    steps = frames["steps"].with_columns(
        pl.when(stalls).then(pl.col("data_s") + 0.3).otherwise(pl.col("data_s")).alias("data_s")
    )
    findings = analyze(steps)
    # Slow in half of the steps is persistently slow on average: data stragglers, each
    # named once (not also as a dataloader stall).
    found = _kind(findings, "straggler_rank")
    assert [(f.ranks, f.cause) for f in found] == [([3], "data"), ([11], "data")]
    assert all(f.evidence["excess_s"]["data_s"] == pytest.approx(0.15, rel=0.1) for f in found)
    assert _kind(findings, "dataloader_stall") == []


def test_busbw_drop_is_a_slow_collective() -> None:
    spec = JobSpec(num_ranks=32, num_steps=600, busbw_shifts=((300, 0.5),), seed=5)
    frames = to_frames(generate(spec))
    (f,) = _kind(analyze(frames["steps"], collectives=frames["collectives"]), "slow_collective")
    assert (f.metric, f.cause, f.last_step) == ("all_reduce.busbw_bps", "communication", None)
    assert f.first_step == pytest.approx(300, abs=3)
    assert f.expected == pytest.approx(spec.busbw_bps, rel=0.05)
    assert f.effect == pytest.approx(-0.5, abs=0.05)
    assert f.severity == "critical"
    assert f.evidence["message_bytes_at_least"] <= spec.allreduce_bytes / spec.num_buckets


def test_busbw_below_the_expectation_is_a_slow_collective() -> None:
    spec = JobSpec(num_ranks=32, num_steps=400, seed=6)
    frames = to_frames(generate(spec))
    config = AnalysisConfig(expected_busbw_bps={"all_reduce": 2 * spec.busbw_bps})
    findings = analyze(frames["steps"], collectives=frames["collectives"], config=config)
    (f,) = _kind(findings, "slow_collective")
    assert f.expected == 2 * spec.busbw_bps
    assert f.effect == pytest.approx(-0.5, abs=0.05)
    assert f.evidence["norm"] == "expected"
    assert f.first_step == 20
    # Meeting the expectation gives no finding.
    config = AnalysisConfig(expected_busbw_bps={"all_reduce": spec.busbw_bps})
    findings = analyze(frames["steps"], collectives=frames["collectives"], config=config)
    assert _kind(findings, "slow_collective") == []
