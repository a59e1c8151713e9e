"""The collectives chart: bus bandwidth by op and message size, and over steps."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from stepscope.figures.base import (
    BASE_LAYOUT,
    MARGIN,
    f32,
    grid_layout,
    merged,
    message_figure,
    text,
)
from stepscope.query import CollectiveStats
from stepscope.text import numbers


def collective_name(group: str, op: str) -> str:
    """'tp all_gather', 'group 3 all_reduce'; the op alone when the group is not known."""
    return op if group in ("", "all") else f"{group} {op}"


def collectives_figure(stats: CollectiveStats) -> go.Figure:
    """Bus bandwidth per process group and op by message size (left) and over steps
    (right); named by op alone when no group is known ("all")."""
    if not stats.sizes.op and not stats.series:
        return message_figure("No collectives reported")
    traces: list[go.Bar | go.Scatter] = []
    s = stats.sizes
    keys = list(zip(s.group, s.op, strict=True))
    for group, op in dict.fromkeys(keys):
        at = np.array([k == (group, op) for k in keys])
        name = collective_name(group, op)
        sizes = [
            "no bytes" if k < 0 else f"≥ {numbers.size(2.0**k)}" for k in s.size_log2[at].tolist()
        ]
        traces.append(
            go.Bar(
                x=sizes,
                y=f32(s.busbw_p50_bps[at]),
                name=text(name),
                legendgroup=f"{group}/{op}",
                customdata=s.num_steps[at],
                hovertemplate="%{x}<br>%{y:.3s}B/s<br>%{customdata} steps<extra>"
                + text(name)
                + "</extra>",
                xaxis="x",
                yaxis="y",
            )
        )
    for series in stats.series:
        for values, dash, label in (
            (series.busbw_p50_bps, "solid", "median rank"),
            (series.busbw_min_bps, "dot", "slowest rank"),
        ):
            traces.append(
                go.Scatter(
                    x=series.step,
                    y=f32(values),
                    name=text(f"{collective_name(series.group, series.op)} ({label})"),
                    legendgroup=f"{series.group}/{series.op}",
                    mode="lines",
                    line={"dash": dash, "width": 1.2},
                    hovertemplate="step %{x}<br>%{y:.3s}B/s<extra>%{fullData.name}</extra>",
                    xaxis="x2",
                    yaxis="y2",
                )
            )
    busbw = {"title": {"text": "bus bandwidth"}, "exponentformat": "SI", "ticksuffix": "B/s"}
    layout = merged(
        grid_layout(
            1,
            2,
            column_widths=(0.4, 0.6),
            horizontal_spacing=0.08,
            subplot_titles=("median busbw by message size", "busbw over steps"),
        ),  # fmt: skip
        {
            **BASE_LAYOUT,
            "legend": {**BASE_LAYOUT["legend"], "y": 1.12},
            "margin": {**MARGIN, "l": 90, "t": 110},  # subplot titles under the legend
            "height": 380,
            "barmode": "group",
            "yaxis": busbw,
            "yaxis2": busbw,
            "xaxis2": {"title": {"text": "step"}},
        },
    )
    return go.Figure(data=traces, layout=layout)
