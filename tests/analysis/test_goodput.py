"""Goodput on timelines with known truth: every category within 0.5 percentage points."""

from __future__ import annotations

import json

import polars as pl
import pytest

from stepscope.analysis.goodput.job import Goodput, goodput, lifecycles
from stepscope.schema import GOODPUT_CATEGORIES
from stepscope.synthetic.goodput_timelines import Failure, Scenario, Timeline, generate

TOLERANCE_PP = 0.5


def _score(timeline: Timeline) -> Goodput:
    return goodput(
        timeline.steps,
        lifecycles(timeline.events),
        world_size=timeline.world_size,
        ended_at=timeline.ended_at,
        hangs=timeline.hangs,
    )


def _assert_matches_truth(timeline: Timeline) -> Goodput:
    result = _score(timeline)
    assert result.total_s == pytest.approx(timeline.total_s, rel=1e-9)
    assert sum(result.categories.values()) == pytest.approx(result.total_s, rel=1e-9)
    for category in GOODPUT_CATEGORIES:
        measured = 100 * result.share(category)
        truth = 100 * timeline.truth[category] / timeline.total_s
        assert measured == pytest.approx(truth, abs=TOLERANCE_PP), category
    return result


def test_no_failure_goodput_equals_the_truth() -> None:
    result = _assert_matches_truth(generate(Scenario(seed=1)))
    assert len(result.incarnations) == 1
    assert result.categories["restart_downtime"] == 0.0
    assert result.categories["lost_progress"] == 0.0


def test_crash_resuming_from_an_older_checkpoint_loses_the_steps_run_since() -> None:
    timeline = generate(Scenario(seed=2, failures=[Failure(at_step=80, downtime_s=300.0)]))
    result = _assert_matches_truth(timeline)
    first, second = result.incarnations
    assert first.lost_steps == [50, 79]
    assert first.resumed_at == 50
    assert second.first_step == 50
    assert first.failure is not None
    assert first.failure["rank"] == 0
    assert 100 * result.share("restart_downtime") > 1.0


def test_crash_resuming_at_the_next_step_is_still_a_restart() -> None:
    # ml-goodput-measurement scores this 98.97 % against a true 51.55 % (research §4.1, C).
    timeline = generate(
        Scenario(seed=3, failures=[Failure(at_step=80, resume="next", downtime_s=900.0)])
    )
    result = _assert_matches_truth(timeline)
    first, _ = result.incarnations
    assert first.lost_steps is None
    assert first.resumed_at == 80
    assert result.categories["restart_downtime"] == pytest.approx(
        timeline.truth["restart_downtime"], rel=1e-6
    )


def test_a_600_s_stall_inside_one_step_is_hang() -> None:
    # ml-goodput-measurement: 98.77 % against a true 61.73 % (research §4.1, D).
    timeline = generate(Scenario(seed=4, stall=(100, 600.0)))
    result = _assert_matches_truth(timeline)
    assert result.share("hang") > 0.5


def test_a_hang_until_aborted_counts_from_the_stall_with_its_detection_time() -> None:
    timeline = generate(
        Scenario(seed=5, failures=[Failure(at_step=120, kind="hang", detect_s=45.0)])
    )
    result = _assert_matches_truth(timeline)
    assert result.incarnations[0].hang_detection_s == pytest.approx(45.0)


def test_checkpoints_and_evaluation_are_their_own_categories() -> None:
    timeline = generate(Scenario(seed=6, ckpt_every=25, ckpt_s=8.0, eval_every=40, eval_s=20.0))
    result = _assert_matches_truth(timeline)
    assert result.categories["checkpoint_save"] == pytest.approx(8 * 8.0 * 7)
    assert result.categories["eval"] == pytest.approx(8 * 20.0 * 4)


def test_a_slow_node_for_part_of_the_job_is_straggler_wait() -> None:
    timeline = generate(Scenario(seed=7, world_size=16, slow=([8, 9, 10, 11], 40, 160, 1.25)))
    result = _assert_matches_truth(timeline)
    assert result.share("straggler_wait") > 0.05


def _event(rank: int, ts: float, kind: str, message: str | None = None, **attrs: object) -> tuple:
    return (rank, ts, kind, message, json.dumps(attrs))


def worked_example() -> Goodput:
    """docs/goodput.md's worked example, built as the store would hold it, scored."""
    events = []
    for r in range(4):
        first, second = f"a{r}", f"b{r}"
        events += [
            _event(r, 0.0, "start", incarnation=first, submitted_at=-60.0),
            _event(r, 20.0, "resume", incarnation=first, step=0),
            _event(r, 25.0, "phase", incarnation=first, name="checkpoint_save", duration_s=4.0),
            _event(r, 62.5, "start", incarnation=second, restart_count=1),
            _event(r, 70.5, "phase", incarnation=second, name="checkpoint_load", duration_s=2.0),
            _event(r, 72.5, "resume", incarnation=second, step=5, resumed_from=5),
            _event(r, 77.5, "exit", incarnation=second),
        ]
    events.append(_event(2, 32.5, "exception", "RuntimeError: injected failure", step=8))
    starts = [20.0, 21.0, 22.0, 23.0, 24.0, 29.0, 30.0, 31.0]  # steps 0-7, first run
    steps = pl.DataFrame(
        {
            "step": list(range(8)),
            "ts": starts,
            "num_ranks": [4] * 8,
            "step_s_sum": [4.0] * 8,
            "step_s_max": [1.0] * 8,
            "data_s_sum": [0.4] * 8,
            "comm_wait_s_sum": [0.4] * 8,
            "transfer_s_sum": [0.4] * 8,
        }
    )
    frame = pl.DataFrame(
        events,
        schema=["rank", "ts", "kind", "message", "attributes"],
        orient="row",
    )
    return goodput(steps, lifecycles(frame), world_size=4)


def test_an_exception_belongs_to_the_incarnation_it_names_whatever_its_time() -> None:
    # A peer of the crashed rank raises in its collective after the restarted processes'
    # start as /proc gives it (boot time in whole seconds): it still ended the first run.
    events = []
    for r in range(2):
        events += [
            _event(r, 0.0, "start", incarnation=f"a{r}"),
            _event(r, 1.0, "resume", incarnation=f"a{r}", step=0),
            _event(r, 10.0, "start", incarnation=f"b{r}", restart_count=1),
            _event(r, 11.0, "resume", incarnation=f"b{r}", step=5, resumed_from=5),
            _event(r, 15.0, "exit", incarnation=f"b{r}"),
        ]
    events.append(_event(1, 9.5, "exception", "RuntimeError: injected", step=8, incarnation="a1"))
    events.append(_event(0, 10.2, "exception", "RuntimeError: peer gone", step=8, incarnation="a0"))
    steps = pl.DataFrame(
        {
            "step": list(range(8)),
            "ts": [1.0 + i for i in range(8)],
            "num_ranks": [2] * 8,
            "step_s_sum": [2.0] * 8,
            "step_s_max": [1.0] * 8,
            "data_s_sum": [0.0] * 8,
            "comm_wait_s_sum": [0.0] * 8,
            "transfer_s_sum": [0.0] * 8,
        }
    )
    frame = pl.DataFrame(
        events, schema=["rank", "ts", "kind", "message", "attributes"], orient="row"
    )
    first, second = goodput(steps, lifecycles(frame), world_size=2).incarnations
    assert first.failure == {"rank": 1, "ts": 9.5, "message": "RuntimeError: injected", "step": 8}
    assert second.failure is None


def test_a_step_belongs_to_its_run_when_the_restart_start_rounds_before_it() -> None:
    # The restarted processes' start, as /proc gives it (boot time in whole seconds), reads
    # 9.0 though they started after step 7 of the first run (9.2 - 10.2): that step is still
    # the first run's, lost with steps 5 and 6 when the second run resumes from step 5.
    events = []
    for r in range(2):
        events += [
            _event(r, 0.0, "start", incarnation=f"a{r}"),
            _event(r, 2.2, "resume", incarnation=f"a{r}", step=0),
            _event(r, 9.0, "start", incarnation=f"b{r}", restart_count=1),
            _event(r, 11.0, "resume", incarnation=f"b{r}", step=5, resumed_from=5),
            _event(r, 15.0, "exit", incarnation=f"b{r}"),
        ]
    steps = pl.DataFrame(
        {
            "step": [*range(8), *range(5, 9)],
            "ts": [2.2 + i for i in range(8)] + [11.0 + i for i in range(4)],
            "num_ranks": [2] * 12,
            "step_s_sum": [2.0] * 12,
            "step_s_max": [1.0] * 12,
            "data_s_sum": [0.0] * 12,
            "comm_wait_s_sum": [0.0] * 12,
            "transfer_s_sum": [0.0] * 12,
        }
    )
    frame = pl.DataFrame(
        events, schema=["rank", "ts", "kind", "message", "attributes"], orient="row"
    )
    first, second = goodput(steps, lifecycles(frame), world_size=2).incarnations
    assert first.lost_steps == [5, 7]
    assert (second.first_step, second.last_step) == (5, 8)


def test_the_worked_example_of_the_docs() -> None:
    result = worked_example()
    assert result.total_s == pytest.approx(310.0)
    expected = {
        "productive": 32.0,
        "startup": 112.0,
        "checkpoint_save": 16.0,
        "checkpoint_load": 8.0,
        "data": 4.0,
        "exposed_comm": 4.0,
        "restart_downtime": 120.0,
        "lost_progress": 14.0,
    }
    for category in GOODPUT_CATEGORIES:
        assert result.categories[category] == pytest.approx(
            expected.get(category, 0.0), abs=1e-9
        ), category
    assert result.layers["scheduling"] == pytest.approx(77.5 / 137.5)
    assert result.layers["runtime"] == pytest.approx(40 / 310)
    assert result.layers["program"] == pytest.approx(0.8)
    first, second = result.incarnations
    assert (first.lost_steps, first.interrupted_step) == ([5, 7], 8)
    assert first.failure == {
        "rank": 2,
        "ts": 32.5,
        "message": "RuntimeError: injected failure",
        "step": 8,
    }
    assert (second.first_step, second.resumed_at) == (5, None)
