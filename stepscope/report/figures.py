"""Figures of a job and of the gate's verdict: data in, a plotly Figure out (no I/O, no query).

Shared by the HTML report and, later, the dashboard.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from numpy.typing import ArrayLike

COLORS = {
    "data_s": "#f2a541",
    "compute_s": "#4c78a8",
    "comm_wait_s": "#b279a2",
    "step_s": "#4c78a8",
    "band": "rgba(76, 120, 168, 0.2)",
    "tokens_per_s": "#54a24b",
    "mfu": "#e45756",
    "candidate": "#e45756",
    "baseline": "#4c78a8",
}
_LAYOUT = {
    "template": "plotly_white",
    "height": 320,
    "margin": {"l": 60, "r": 30, "t": 40, "b": 40},
    "legend": {"orientation": "h", "y": -0.2},
    "hovermode": "x unified",
}


def step_time_band(
    steps: ArrayLike, min_s: ArrayLike, p50_s: ArrayLike, max_s: ArrayLike
) -> go.Figure:
    """Step time per step: the median rank's line in the band from the fastest to the slowest."""
    x = np.asarray(steps)
    fig = go.Figure(
        [
            go.Scatter(
                x=x,
                y=np.asarray(max_s),
                name="slowest rank",
                mode="lines",
                line={"width": 0},
                showlegend=False,
                hoverinfo="skip",
            ),
            go.Scatter(
                x=x,
                y=np.asarray(min_s),
                name="min–max over ranks",
                mode="lines",
                line={"width": 0},
                fill="tonexty",
                fillcolor=COLORS["band"],
            ),
            go.Scatter(
                x=x,
                y=np.asarray(p50_s),
                name="median rank",
                mode="lines",
                line={"color": COLORS["step_s"], "width": 1.5},
            ),
        ]
    )
    fig.update_layout(
        **_LAYOUT, title="Step time", xaxis_title="step", yaxis_title="s", yaxis_rangemode="tozero"
    )
    return fig


def throughput(
    steps: ArrayLike,
    tokens_per_s: ArrayLike,
    *,
    mfu_steps: ArrayLike | None = None,
    mfu: ArrayLike | None = None,
    change_points: Sequence[tuple[int, str]] = (),
) -> go.Figure:
    """Tokens/s (left axis) and MFU (right axis) per step, change points as dashed lines."""
    fig = go.Figure(
        go.Scatter(
            x=np.asarray(steps),
            y=np.asarray(tokens_per_s),
            name="tokens/s",
            mode="lines",
            line={"color": COLORS["tokens_per_s"], "width": 1.5},
        )
    )
    layout = dict(_LAYOUT)
    if mfu is not None and mfu_steps is not None and np.asarray(mfu).size:
        fig.add_trace(
            go.Scatter(
                x=np.asarray(mfu_steps),
                y=np.asarray(mfu) * 100.0,
                name="MFU (%)",
                mode="lines",
                line={"color": COLORS["mfu"], "width": 1},
                yaxis="y2",
            )
        )
        layout["yaxis2"] = {"title": "MFU (%)", "overlaying": "y", "side": "right"}
    for step, label in change_points:
        fig.add_vline(
            x=step,
            line_dash="dash",
            line_color="#888",
            annotation_text=label,
            annotation_position="top left",
        )
    fig.update_layout(
        **layout, title="Throughput and MFU", xaxis_title="step", yaxis_title="tokens/s"
    )
    return fig


def rank_breakdown(
    ranks: Sequence[int],
    data_s: ArrayLike,
    compute_s: ArrayLike,
    comm_wait_s: ArrayLike,
    *,
    nodes: Sequence[str | None] | None = None,
) -> go.Figure:
    """Each rank's typical step split into data, compute and communication wait (stacked)."""
    labels = [str(r) for r in ranks]
    hover = [
        f"rank {r}" + (f" on {n}" if n else "")
        for r, n in zip(ranks, nodes or [None] * len(labels), strict=True)
    ]
    fig = go.Figure(
        [
            go.Bar(
                x=labels,
                y=np.asarray(values),
                name=name,
                marker_color=COLORS[metric],
                hovertext=hover,
            )
            for metric, name, values in (
                ("data_s", "data", data_s),
                ("compute_s", "compute", compute_s),
                ("comm_wait_s", "comm wait", comm_wait_s),
            )
        ]
    )
    fig.update_layout(
        **_LAYOUT,
        barmode="stack",
        title="Per-rank breakdown (median step)",
        xaxis={"title": "rank", "type": "category"},
        yaxis_title="s",
    )
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
    """Each baseline job's level (in time order), the candidate's, and the regression limit."""
    fig = go.Figure()
    if len(dropped_ids):
        fig.add_trace(
            go.Scatter(
                x=list(dropped_ids),
                y=np.asarray(dropped_values),
                mode="markers",
                name="dropped baselines",
                marker={"color": "#bbb", "symbol": "x", "size": 9},
            )
        )
    fig.add_trace(
        go.Scatter(
            x=list(job_ids),
            y=np.asarray(values),
            mode="markers+lines",
            name="baselines",
            marker={"color": COLORS["baseline"], "size": 9},
            line={"width": 1, "dash": "dot"},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=list(candidate_ids),
            y=np.asarray(candidate_values),
            mode="markers",
            name="candidate",
            marker={"color": COLORS["candidate"], "size": 12, "symbol": "diamond"},
        )
    )
    if limit is not None:
        fig.add_hline(
            y=limit,
            line_dash="dash",
            line_color=COLORS["candidate"],
            annotation_text="regression limit",
        )
    fig.update_layout(
        **{**_LAYOUT, "hovermode": "closest"},
        title=f"{metric}: job levels",
        xaxis={"title": "job", "type": "category"},
        yaxis_title=metric,
    )
    return fig
