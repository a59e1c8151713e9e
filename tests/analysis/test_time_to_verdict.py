"""Time to a verdict: a straggler large against the noise is named within a few steps of its
onset, a small one after `min_steps`; a short job gets a verdict."""

from __future__ import annotations

import polars as pl
import pytest

from stepscope.analysis import AnalysisConfig, analyze
from stepscope.schema import Finding
from stepscope.synthetic.generate import JobSpec, Straggler, generate, to_frames

STRAGGLER_KINDS = ("straggler_rank", "straggler_node", "gpu_throttling")


def _stragglers(spec: JobSpec, *, last_step: int | None = None) -> list[Finding]:
    """The straggler findings of the job, as a live analysis sees it at `last_step`."""
    frames = to_frames(generate(spec))
    steps, collectives = frames["steps"], frames["collectives"]
    if last_step is not None:
        steps = steps.filter(pl.col("step") <= last_step)
        collectives = collectives.filter(pl.col("step") <= last_step)
    findings = analyze(steps, collectives=collectives)
    return [f for f in findings if f.kind in STRAGGLER_KINDS]


@pytest.mark.parametrize("num_ranks", [4, 8])
def test_a_60_step_job_with_a_40_percent_straggler_from_warm_up_gets_a_verdict(
    num_ranks: int,
) -> None:
    warmup = AnalysisConfig().warmup_steps
    spec = JobSpec(
        num_ranks=num_ranks,
        num_steps=60,
        seed=3,
        stragglers=(Straggler(ranks=(1,), factor=1.4, cause="compute", from_step=warmup),),
    )
    found = _stragglers(spec)
    assert [(f.kind, f.ranks, f.cause, f.first_step, f.last_step) for f in found] == [
        ("straggler_rank", [1], "compute", warmup, None)
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_40_percent_straggler_is_named_within_20_steps_of_its_onset(seed: int) -> None:
    onset = 80
    spec = JobSpec(
        num_ranks=32,
        num_steps=200,
        seed=seed,
        stragglers=(Straggler(ranks=(5,), factor=1.4, cause="compute", from_step=onset),),
    )
    # What the server's live analysis has 20 steps after the onset.
    live = _stragglers(spec, last_step=onset + 20)
    assert [(f.ranks, f.cause, f.first_step, f.last_step) for f in live] == [
        ([5], "compute", onset, None)
    ]
    # The whole job's finding says when the steps confirmed it.
    (whole,) = _stragglers(spec)
    assert onset + 9 <= whole.evidence["detected_step"] <= onset + 20


def test_a_large_slowdown_is_confirmed_sooner_than_a_small_one() -> None:
    onset = 100

    def detected(factor: float) -> int:
        spec = JobSpec(
            num_ranks=32,
            num_steps=300,
            seed=11,
            stragglers=(Straggler(ranks=(9,), factor=factor, cause="compute", from_step=onset),),
        )
        (found,) = _stragglers(spec)
        assert (found.ranks, found.first_step) == ([9], onset)
        return int(found.evidence["detected_step"]) - onset

    small, large = detected(1.03), detected(1.4)
    assert large < small, (large, small)


def test_a_large_slowdown_from_the_warm_ups_end_that_recovers_is_named() -> None:
    # The demo's data loader: slow from the first step compared for 40 steps (less than a
    # window), far beyond a warm-up's tail.
    warmup = AnalysisConfig().warmup_steps
    spec = JobSpec(
        num_ranks=4,
        num_steps=100,
        seed=5,
        stragglers=(
            Straggler(ranks=(1,), factor=1.3, cause="data", from_step=warmup, until_step=60),
        ),
    )
    found = _stragglers(spec)
    assert [(f.ranks, f.cause, f.first_step, f.last_step) for f in found] == [
        ([1], "data", warmup, 59)
    ]
