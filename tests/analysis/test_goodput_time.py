"""Goodput over time: every category placed in consecutive windows, against hand-computed
truth (the worked example of docs/goodput.md) and against the job's totals."""

from __future__ import annotations

import pytest

from stepscope.analysis.goodput.job import windows, within
from stepscope.analysis.goodput.timeline import default_window_s
from stepscope.schema import GOODPUT_CATEGORIES
from stepscope.synthetic.goodput_timelines import Failure, Scenario, generate
from tests.analysis.test_goodput import _score as score
from tests.analysis.test_goodput import worked_example

# Worked example in 10 s windows (4 ranks, 0-77.5 s): startup to 20; steps 0-4 (productive
# 3.2, data 0.4, comm 0.4 GPU-s each) from 20; checkpoint save 25-29; steps 5-7 (lost) 29-32;
# the interrupted step 32-32.5; restart downtime to 62.5; startup to 72.5 less a 2 s
# checkpoint load from 70.5; steps 5-9 run again 72.5-77.5 (split as their first run).
EXPECTED_10S = [
    {"startup": 40.0},
    {"startup": 40.0},
    {"productive": 16.0, "data": 2.0, "exposed_comm": 2.0, "checkpoint_save": 16.0,
     "lost_progress": 4.0},
    {"lost_progress": 10.0, "restart_downtime": 30.0},
    {"restart_downtime": 40.0},
    {"restart_downtime": 40.0},
    {"restart_downtime": 10.0, "startup": 30.0},
    {"startup": 2.0, "checkpoint_load": 8.0, "productive": 16.0, "data": 2.0,
     "exposed_comm": 2.0},
]  # fmt: skip


def test_windows_of_the_worked_example_equal_the_hand_computed_truth() -> None:
    frame = windows(worked_example(), 10.0)
    assert frame["start"].to_list() == [10.0 * i for i in range(8)]
    assert frame["gpu_s"].to_list() == pytest.approx([40.0] * 7 + [30.0])
    for i, expected in enumerate(EXPECTED_10S):
        for category in GOODPUT_CATEGORIES:
            assert frame[category][i] == pytest.approx(expected.get(category, 0.0), abs=1e-9), (
                i,
                category,
            )


def test_windows_add_up_to_the_totals_on_a_job_with_restarts_and_a_hang() -> None:
    timeline = generate(
        Scenario(
            seed=21,
            failures=[
                Failure(at_step=60, downtime_s=120.0),
                Failure(at_step=140, kind="hang", resume="next", detect_s=30.0),
            ],
            stall=(30, 200.0),
            eval_every=50,
        )
    )
    result = score(timeline)
    frame = windows(result)
    span_s = result.ended_at - result.started_at
    assert frame.height == pytest.approx(span_s / default_window_s(span_s), abs=1)
    assert float(frame["gpu_s"].sum()) == pytest.approx(result.total_s, rel=1e-9)
    for category in GOODPUT_CATEGORIES:
        assert float(frame[category].sum()) == pytest.approx(
            result.categories[category], rel=1e-6, abs=1e-6
        ), category
    assert float(frame["hang"].max()) > 0.0
    # A window inside the restart downtime holds nothing else.
    first_end = result.incarnations[0].ended_at
    second_start = result.incarnations[1].started_at
    quiet = within(result, first_end + 1.0, second_start - 1.0)
    assert quiet["restart_downtime"] == pytest.approx(quiet["gpu_s"], rel=1e-9)


def test_within_clips_the_job_to_the_window() -> None:
    result = worked_example()
    part = within(result, 30.0, 50.0)
    assert part["gpu_s"] == pytest.approx(80.0)
    assert part["restart_downtime"] == pytest.approx(70.0)
    assert part["lost_progress"] == pytest.approx(10.0)
    outside = within(result, 100.0, 200.0)
    assert outside["gpu_s"] == 0.0
    assert sum(outside[c] for c in GOODPUT_CATEGORIES) == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("span_s", "window_s"), [(77.5, 1.0), (1000.0, 10.0), (86400.0, 900.0), (3e7, 345600.0)]
)
def test_the_default_window_cuts_a_job_in_at_most_100(span_s: float, window_s: float) -> None:
    assert default_window_s(span_s) == window_s


def test_a_window_far_longer_than_the_job_holds_it_whole() -> None:
    result = score(generate(Scenario(seed=22, failures=[Failure(at_step=70)], eval_every=40)))
    (row,) = windows(result, 1e300).iter_rows(named=True)
    assert row["gpu_s"] == pytest.approx(result.total_s, rel=1e-9)
    for category in GOODPUT_CATEGORIES:
        assert row[category] == pytest.approx(result.categories[category], abs=1e-6), category
