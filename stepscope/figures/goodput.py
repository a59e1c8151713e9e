"""Where a job's GPU-time went (docs/goodput.md): per incarnation, stacked by category."""

from __future__ import annotations

import plotly.graph_objects as go

from stepscope.figures.base import BASE_LAYOUT, merged, message_figure
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
