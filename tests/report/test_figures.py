"""Report figures are pure functions of their data; embedded figure data cannot close a tag."""

from __future__ import annotations

import numpy as np
import pytest

from stepscope.report import figures
from stepscope.report.html import _figure


def test_step_time_band_draws_the_band_and_the_median() -> None:
    fig = figures.step_time_band([0, 1, 2], [0.9, 1.0, 1.1], [1.0, 1.1, 1.2], [1.5, 1.2, 1.3])
    top, bottom, median = fig.data
    assert list(top.y) == [1.5, 1.2, 1.3]
    assert bottom.fill == "tonexty"
    assert list(median.y) == [1.0, 1.1, 1.2]
    assert list(median.x) == [0, 1, 2]


def test_throughput_puts_mfu_on_a_second_axis_and_marks_change_points() -> None:
    fig = figures.throughput(
        [0, 1], [100.0, 90.0], mfu_steps=[0, 1], mfu=[0.5, 0.45], change_points=[(1, "-10%")]
    )
    tokens, mfu = fig.data
    assert list(tokens.y) == [100.0, 90.0]
    assert list(mfu.y) == pytest.approx([50.0, 45.0])
    assert mfu.yaxis == "y2"
    assert [shape.x0 for shape in fig.layout.shapes] == [1]
    assert fig.layout.annotations[0].text == "-10%"
    assert len(figures.throughput([0], [1.0], mfu_steps=[], mfu=[]).data) == 1


def test_rank_breakdown_stacks_the_components_per_rank() -> None:
    fig = figures.rank_breakdown(
        [0, 1],
        np.array([0.1, 0.2]),
        np.array([1.0, 1.1]),
        np.array([0.3, 0.0]),
        nodes=["a", None],
    )
    assert [t.name for t in fig.data] == ["data", "compute", "comm wait"]
    assert list(fig.data[1].y) == [1.0, 1.1]
    assert list(fig.data[0].hovertext) == ["rank 0 on a", "rank 1"]
    assert fig.layout.barmode == "stack"


def test_baseline_levels_show_the_candidate_against_the_limit() -> None:
    fig = figures.baseline_levels(
        "step_s",
        ["b1", "b2"],
        [1.0, 1.01],
        candidate_ids=["c"],
        candidate_values=[1.2],
        limit=1.05,
        dropped_ids=["old"],
        dropped_values=[1.3],
    )
    assert [t.name for t in fig.data] == ["dropped baselines", "baselines", "candidate"]
    assert list(fig.data[2].x) == ["c"]
    assert fig.layout.shapes[0].y0 == 1.05


def test_embedded_figure_data_cannot_close_the_script() -> None:
    hostile = "</script><script>alert(1)</script>"
    fig = figures.baseline_levels(
        "step_s", [hostile], [1.0], candidate_ids=["c&d"], candidate_values=[1.1], limit=None
    )
    html = _figure(fig, "fig-x")
    assert html.count("</script>") == 1
    assert "\\u003cscript\\u003e" in html
