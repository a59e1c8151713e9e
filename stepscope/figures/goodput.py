"""Where a job's GPU-time went (docs/goodput.md): per incarnation and over time, stacked by
category."""

from __future__ import annotations

from datetime import UTC, datetime

import plotly.graph_objects as go

from stepscope.figures.base import BASE_LAYOUT, merged, message_figure, vline
from stepscope.query.goodput import JobGoodput
from stepscope.schema import GOODPUT_CATEGORIES
from stepscope.text.labels import goodput_category

GOODPUT_COLORS = {
    "productive": "#2e7d32",
    "startup": "#90a4ae",
    "compile": "#b0bec5",
    "checkpoint_save": "#1565c0",
    "checkpoint_load": "#64b5f6",
    "eval": "#5e35b1",
    "other_phase": "#9575cd",
    "data": "#8e24aa",
    "exposed_comm": "#f9a825",
    "straggler_wait": "#ef6c00",
    "hang": "#c62828",
    "restart_downtime": "#6d4c41",
    "lost_progress": "#e57373",
    "unaccounted": "#e0e0e0",
}


def goodput_figure(answer: JobGoodput) -> go.Figure:
    """One horizontal bar per incarnation (a restart starts a new bar), its GPU-hours stacked
    by category, productive first."""
    result = answer.result
    if not result.incarnations or result.total_s <= 0:
        return message_figure("No goodput yet: no lifecycle events or steps stored")
    names = [
        f"incarnation {i.index}" + (f" (from step {i.first_step})" if i.first_step else "")
        for i in result.incarnations
    ]
    traces = []
    for category in GOODPUT_CATEGORIES:
        hours = [max(0.0, i.categories.get(category, 0.0)) / 3600 for i in result.incarnations]
        if not any(hours):
            continue
        traces.append(
            go.Bar(
                name=goodput_category(category),
                y=names,
                x=hours,
                orientation="h",
                marker_color=GOODPUT_COLORS[category],
                hovertemplate=f"{goodput_category(category, long=True)}: %{{x:.3f}} GPU-h"
                "<extra></extra>",
            )
        )
    layout = merged(
        BASE_LAYOUT,
        {
            "barmode": "stack",
            "height": 160 + 40 * len(names),
            "xaxis": {"title": {"text": "GPU-hours"}},
            "yaxis": {"autorange": "reversed"},
        },
    )
    return go.Figure(traces, layout)


RESTART_COLOR = "#37474f"


def goodput_time_figure(answer: JobGoodput) -> go.Figure:
    """Goodput over time: per window, the mean number of GPUs in each category (stacked, so
    the stack is the world size), with a dashed line where each restart's processes began."""
    frame = answer.windows
    if frame is None or frame.height == 0 or not answer.window_s:
        return message_figure("No goodput over time yet: no lifecycle events or steps stored")
    x = [_utc(t) for t in frame["start"].to_list()]
    traces = []
    for category in GOODPUT_CATEGORIES:
        gpus = (frame[category] / answer.window_s).to_list()
        if not any(abs(v) > 1e-12 for v in gpus):
            continue
        traces.append(
            go.Scatter(
                name=goodput_category(category),
                x=x,
                y=gpus,
                mode="lines",
                line={"width": 0.5, "shape": "hv", "color": GOODPUT_COLORS[category]},
                stackgroup="goodput",
                hovertemplate=f"{goodput_category(category, long=True)}: %{{y:.2f}} GPUs"
                "<extra></extra>",
            )
        )
    restarts = answer.result.incarnations[1:]
    layout = merged(
        BASE_LAYOUT,
        {
            "height": 320,
            "xaxis": {"title": {"text": f"time (UTC), {answer.window_s:g} s windows"}},
            "yaxis": {"title": {"text": "GPUs (mean in the window)"}},
            "shapes": [
                vline(_utc(i.started_at), RESTART_COLOR, "dash")  # type: ignore[arg-type]
                for i in restarts
            ],
            "annotations": [
                {
                    "x": _utc(i.started_at),
                    "y": 1,
                    "xref": "x",
                    "yref": "paper",
                    "text": f"restart {i.index}",
                    "showarrow": False,
                    "xanchor": "left",
                    "yanchor": "bottom",
                }
                for i in restarts
            ],
        },
    )
    return go.Figure(traces, layout)


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)
