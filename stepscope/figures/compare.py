"""Jobs side by side: two jobs' series overlaid, their time components, and the CI gate's
baseline jobs against the candidate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from numpy.typing import ArrayLike

from stepscope.figures.base import (
    BASE_LAYOUT,
    BASELINE_COLOR,
    CANDIDATE_COLOR,
    SEVERITY_COLORS,
    f32,
    message_figure,
    text,
)
from stepscope.query import Series
from stepscope.text.labels import component


def overlay_figure(
    baseline: Series, candidate: Series, *, names: tuple[str, str], title: str, unit: str
) -> go.Figure:
    """Two jobs' series of one metric over steps, overlaid."""
    if baseline.step.size == 0 and candidate.step.size == 0:
        return message_figure(f"Neither job has {title} yet")
    fig = go.Figure()
    for series, name, color in (
        (baseline, names[0], BASELINE_COLOR),
        (candidate, names[1], CANDIDATE_COLOR),
    ):
        fig.add_trace(
            go.Scatter(
                x=series.step, y=f32(series.value), name=text(name), mode="lines",
                line={"color": color, "width": 1.4},
                hovertemplate="step %{x}<br>%{y:.4g} " + unit + "<extra>%{fullData.name}</extra>",
            )
        )  # fmt: skip
    fig.update_layout(
        **BASE_LAYOUT, height=300, title={"text": text(title), "x": 0},
        xaxis_title="step", yaxis={"title": unit, "rangemode": "tozero"},
    )  # fmt: skip
    return fig


def components_figure(
    components: Sequence[tuple[str, float | None, float | None]], *, names: tuple[str, str]
) -> go.Figure:
    """Seconds per step of each time component, baseline beside candidate."""
    x = [component(f"{c}_s", default=c) for c, _, _ in components]
    fig = go.Figure()
    for i, (name, color) in enumerate(((names[0], BASELINE_COLOR), (names[1], CANDIDATE_COLOR))):
        values = np.array(
            [np.nan if v[i + 1] is None else v[i + 1] for v in components], dtype=np.float32
        )
        fig.add_trace(
            go.Bar(
                x=x, y=values, name=text(name), marker={"color": color},
                hovertemplate="%{x}<br>%{y:.4g} s<extra>%{fullData.name}</extra>",
            )
        )  # fmt: skip
    fig.update_layout(
        **BASE_LAYOUT, barmode="group", height=300, yaxis_title="median seconds per step",
        title={"text": "time components of the step", "x": 0},
    )  # fmt: skip
    return fig


def baseline_levels(
    metric: str,
    job_ids: Sequence[str],
    values: ArrayLike,
    *,
    candidate_ids: Sequence[str],
    candidate_values: ArrayLike,
    limit: float | None,
    dropped_ids: Sequence[str] = (),
    dropped_values: ArrayLike = (),
) -> go.Figure:
    """The CI gate's view: each baseline job's level (in time order), the candidate's, and
    the regression limit."""
    fig = go.Figure()
    if len(dropped_ids):
        fig.add_trace(
            go.Scatter(
                x=[text(j) for j in dropped_ids], y=np.asarray(dropped_values),
                mode="markers", name="dropped baselines",
                marker={"color": "#bdbdbd", "symbol": "x", "size": 9},
            )
        )  # fmt: skip
    fig.add_trace(
        go.Scatter(
            x=[text(j) for j in job_ids], y=np.asarray(values), mode="markers+lines",
            name="baselines", marker={"color": BASELINE_COLOR, "size": 9},
            line={"color": BASELINE_COLOR, "width": 1, "dash": "dot"},
        )
    )  # fmt: skip
    fig.add_trace(
        go.Scatter(
            x=[text(j) for j in candidate_ids], y=np.asarray(candidate_values), mode="markers",
            name="candidate", marker={"color": CANDIDATE_COLOR, "size": 12, "symbol": "diamond"},
        )
    )  # fmt: skip
    if limit is not None:
        fig.add_hline(
            y=limit, line_dash="dash", line_color=SEVERITY_COLORS["critical"],
            annotation_text="regression limit",
        )  # fmt: skip
    fig.update_layout(
        **BASE_LAYOUT, height=320, title={"text": text(f"{metric}: job levels"), "x": 0},
        xaxis={"title": "job", "type": "category"}, yaxis={"title": text(metric)},
    )  # fmt: skip
    return fig
