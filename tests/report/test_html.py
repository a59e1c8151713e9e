"""The report embeds the figure library's charts; embedded figure data cannot close a tag."""

from __future__ import annotations

import plotly.graph_objects as go

from stepscope import figures
from stepscope.report.html import _figure


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
    assert fig.data[2].marker.color == figures.base.CANDIDATE_COLOR


def test_job_ids_in_the_levels_are_escaped_for_plotly() -> None:
    fig = figures.baseline_levels(
        "step_s", ["<b>x</b>"], [1.0], candidate_ids=["c&d"], candidate_values=[1.1], limit=None
    )
    assert list(fig.data[0].x) == ["&lt;b&gt;x&lt;/b&gt;"]
    assert list(fig.data[1].x) == ["c&amp;d"]


def test_embedded_figure_data_cannot_close_the_script() -> None:
    hostile = "</script><script>alert(1)</script>"
    html = _figure(go.Figure(layout={"title": {"text": hostile}}), "fig-x")
    assert html.count("</script>") == 1
    assert "\\u003cscript\\u003e" in html
