"""The goodput chart: one bar per incarnation, stacked by category, values read back."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import numpy as np
import pytest

from stepscope import figures
from stepscope.analysis.goodput.job import goodput, lifecycles, windows
from stepscope.query.goodput import JobGoodput
from stepscope.synthetic.goodput_timelines import Failure, Scenario, generate
from stepscope.text.labels import goodput_category


def _answer() -> JobGoodput:
    timeline = generate(Scenario(seed=9, failures=[Failure(at_step=80, downtime_s=120.0)]))
    result = goodput(
        timeline.steps, lifecycles(timeline.events), world_size=8, ended_at=timeline.ended_at
    )
    return JobGoodput(job_id="j", result=result, responsible={}, ranks=None)


def test_each_incarnation_is_a_bar_stacked_by_category() -> None:
    answer = _answer()
    fig = figures.goodput_figure(answer)
    assert fig.layout.barmode == "stack"
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["productive"].y) == ["incarnation 0", "incarnation 1 (from step 50)"]
    for category in ("productive", "restart_downtime", "lost_progress", "checkpoint_save"):
        trace = by_name[goodput_category(category)]
        expected = [i.categories[category] / 3600 for i in answer.result.incarnations]
        np.testing.assert_allclose(np.asarray(trace.x, dtype=float), expected, rtol=1e-9)
        assert trace.marker.color == figures.GOODPUT_COLORS[category]
    total_h = sum(float(np.sum(np.asarray(t.x, dtype=float))) for t in fig.data)
    assert total_h == pytest.approx(answer.result.total_s / 3600, rel=1e-6)


def test_a_job_without_goodput_says_so() -> None:
    empty = JobGoodput(
        job_id="j",
        result=goodput(
            generate(Scenario(num_steps=0)).steps.clear(),
            lifecycles(generate(Scenario(num_steps=0)).events.clear()),
            world_size=1,
        ),
        responsible={},
        ranks=None,
    )
    fig = figures.goodput_figure(empty)
    assert "No goodput yet" in fig.layout.annotations[0].text


def test_goodput_over_time_stacks_the_windows_and_marks_the_restart() -> None:
    base = _answer()
    frame = windows(base.result, 60.0)
    answer = replace(base, window_s=60.0, windows=frame)
    fig = figures.goodput_time_figure(answer)
    by_name = {t.name: t for t in fig.data}
    for category in ("productive", "restart_downtime", "startup"):
        trace = by_name[goodput_category(category)]
        assert trace.stackgroup == "goodput"
        np.testing.assert_allclose(
            np.asarray(trace.y, dtype=float), frame[category].to_numpy() / 60.0, rtol=1e-9
        )
    # Every full window's stack is the world size (8 GPUs).
    stack = sum(np.asarray(t.y, dtype=float) for t in fig.data)
    np.testing.assert_allclose(stack[:-1], 8.0, rtol=1e-9)
    restart = answer.result.incarnations[1].started_at
    (shape,) = fig.layout.shapes
    assert shape.x0 == datetime.fromtimestamp(restart, tz=UTC)
    assert fig.layout.annotations[0].text == "restart 1"
    assert by_name[goodput_category("restart_downtime")].y[
        int((restart - answer.result.started_at) // 60) - 1
    ] == pytest.approx(8.0)


def test_goodput_over_time_without_windows_says_so() -> None:
    fig = figures.goodput_time_figure(_answer())
    assert "No goodput over time yet" in fig.layout.annotations[0].text
