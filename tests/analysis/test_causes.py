"""Throughput and MFU change points name the rank-level finding that caused them, or say
that they are job-wide."""

from __future__ import annotations

import pytest

from stepscope.analysis import AnalysisConfig, analyze, with_causes
from stepscope.schema import Finding
from stepscope.synthetic.generate import JobSpec, SlowNode, Straggler, generate, to_frames
from stepscope.text.findings import finding_line


def _findings(**kwargs: object) -> list[Finding]:
    job = generate(JobSpec(num_ranks=32, num_steps=500, seed=5, **kwargs))  # type: ignore[arg-type]
    frames = to_frames(job)
    return analyze(
        frames["steps"], collectives=frames["collectives"], ranks=frames["ranks"], job=job.job
    )


def _changes(findings: list[Finding], kind: str) -> list[Finding]:
    return [f for f in findings if f.kind == kind]


def test_a_drop_at_a_stragglers_onset_carries_its_rank() -> None:
    findings = _findings(
        stragglers=(Straggler(ranks=(13,), factor=1.1, cause="compute", from_step=200),)
    )

    drops = _changes(findings, "throughput_drop")
    assert sorted(f.metric for f in drops) == ["mfu", "tokens_per_s"]
    (straggler,) = _changes(findings, "straggler_rank")
    for drop in drops:
        assert drop.first_step == pytest.approx(200, abs=5)
        assert (drop.ranks, drop.node, drop.cause) == ([13], "node-0001", "compute")
        (cause,) = drop.evidence["caused_by"]
        assert cause["kind"] == "straggler_rank"
        assert (cause["ranks"], cause["first_step"]) == ([13], straggler.first_step)
        assert cause["step_share"] == straggler.evidence["impact"]["step_share"]
        assert drop.evidence["scope"] == "ranks"
        assert finding_line(drop).endswith("cause rank 13")


def test_a_gain_when_a_straggler_recovers_carries_its_rank() -> None:
    findings = _findings(
        stragglers=(
            Straggler(ranks=(4,), factor=1.15, cause="data", from_step=150, until_step=350),
        )
    )

    (gain,) = [f for f in _changes(findings, "throughput_gain") if f.metric == "tokens_per_s"]
    assert gain.first_step == pytest.approx(350, abs=5)
    assert (gain.ranks, gain.cause) == ([4], "data")
    assert gain.evidence["caused_by"][0]["last_step"] == pytest.approx(349, abs=5)


def test_a_slow_node_is_named_as_the_cause() -> None:
    findings = _findings(slow_nodes=(SlowNode(node=2, factor=1.2, cause="compute", from_step=250),))

    drop = next(f for f in _changes(findings, "throughput_drop") if f.metric == "tokens_per_s")
    assert (drop.ranks, drop.node, drop.cause) == (list(range(16, 24)), "node-0002", "compute")
    assert drop.evidence["scope"] == "node"
    assert finding_line(drop).endswith("cause node-0002")


def test_a_drop_without_a_rank_level_cause_is_job_wide() -> None:
    findings = _findings(throughput_shifts=((250, 1.1),))

    drops = _changes(findings, "throughput_drop")
    assert drops
    for drop in drops:
        assert (drop.ranks, drop.node, drop.cause) == ([], None, None)
        assert (drop.evidence["caused_by"], drop.evidence["scope"]) == ([], "job-wide")
        assert finding_line(drop).endswith("job-wide")


def _straggler(first_step: int, step_share: float) -> Finding:
    return Finding(
        job_id="j",
        kind="straggler_rank",
        severity="warning",
        ranks=[3],
        first_step=first_step,
        cause="compute",
        evidence={"impact": {"step_share": step_share, "gpus": 8 * step_share}},
    )


def _drop(first_step: int, effect: float) -> Finding:
    return Finding(
        job_id="j",
        kind="throughput_drop",
        severity="warning",
        first_step=first_step,
        metric="tokens_per_s",
        effect=effect,
    )


def test_only_a_straggler_that_explains_the_drop_and_coincides_with_it_is_named() -> None:
    config = AnalysisConfig(cause_steps=10)

    def linked(straggler: Finding, drop: Finding) -> Finding:
        return with_causes([drop, straggler], config)[0]

    assert linked(_straggler(195, 0.04), _drop(200, -0.05)).ranks == [3]
    assert linked(_straggler(180, 0.04), _drop(200, -0.05)).ranks == []  # 20 steps apart
    # Costing the job 0.5% of its step time, it does not explain a 10% drop.
    small = linked(_straggler(200, 0.005), _drop(200, -0.10))
    assert (small.ranks, small.evidence["scope"]) == ([], "job-wide")
    # The other findings pass through unchanged.
    straggler = _straggler(200, 0.04)
    assert with_causes([straggler], config) == [straggler]
