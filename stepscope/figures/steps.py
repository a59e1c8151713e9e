"""Charts over steps: the step-time band, throughput and MFU, findings and events marked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go

from stepscope.figures.base import (
    BAND_COLOR,
    BASE_LAYOUT,
    SEVERITY_COLORS,
    f32,
    grid_layout,
    merged,
    message_figure,
    text,
    vline,
)
from stepscope.query import Band, Series
from stepscope.schema import Finding
from stepscope.text import labels, numbers
from stepscope.text.findings import subject

_CHANGE_KINDS = ("throughput_drop", "throughput_gain", "mfu_low")


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """A job event placed on the step axis."""

    step: float
    kind: str
    rank: int
    message: str | None


def band_traces(band: Band, *, legend: bool = True) -> list[go.Scatter]:
    """Min, max (filled between) and median of a band, as scatter traces."""
    step = band.step
    hover = "step %{x}<br>%{y:.4g} s<extra>%{fullData.name}</extra>"
    common = {"x": step, "mode": "lines", "hovertemplate": hover, "legendgroup": "band"}
    return [
        go.Scatter(y=f32(band.min), name="min", line={"width": 0}, showlegend=False, **common),
        go.Scatter(
            y=f32(band.max),
            name="min–max across ranks",
            fill="tonexty",
            fillcolor="rgba(21,101,192,0.18)",
            line={"width": 0},
            showlegend=legend,
            **common,
        ),
        go.Scatter(
            y=f32(band.p50),
            name="median rank",
            line={"color": BAND_COLOR, "width": 1.5},
            showlegend=legend,
            **common,
        ),
    ]


def band_figure(
    band: Band, findings: Sequence[Finding] = (), events: Sequence[Event] = ()
) -> go.Figure:
    """Step time over steps (min / median / max across ranks), findings and events marked."""
    if band.step.size == 0:
        return message_figure("No step has been rolled up yet")
    traces: list[go.Scatter] = band_traces(band)
    layout: dict[str, Any] = {
        **BASE_LAYOUT,
        "height": 320,
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": "step time (s)", "rangemode": "tozero"},
    }
    top = float(np.nanmax(band.max)) * 1.04
    marked = [f for f in findings if f.first_step is not None]
    if marked:
        traces.append(
            go.Scatter(
                x=np.array([f.first_step for f in marked], dtype=np.int64),
                y=np.full(len(marked), top, dtype=np.float32),
                mode="markers",
                name="findings",
                marker={
                    "symbol": "triangle-down",
                    "size": 11,
                    "color": [SEVERITY_COLORS.get(f.severity, "#555") for f in marked],
                },
                hovertext=[text(finding_label(f)) for f in marked],
                hovertemplate="step %{x}<br>%{hovertext}<extra></extra>",
            )
        )
        layout["shapes"] = [
            vline(f.first_step or 0, SEVERITY_COLORS.get(f.severity, "#555"), "dot") for f in marked
        ]
    if events:
        traces.append(
            go.Scatter(
                x=np.array([e.step for e in events], dtype=np.float64),
                y=np.zeros(len(events), dtype=np.float32),
                mode="markers",
                name="events",
                marker={"symbol": "x", "size": 10, "color": "#424242"},
                hovertext=[text(f"{e.kind} on rank {e.rank}: {e.message or ''}") for e in events],
                hovertemplate="step %{x:.0f}<br>%{hovertext}<extra></extra>",
            )
        )
    return go.Figure(data=traces, layout=layout)


def finding_label(f: Finding) -> str:
    """A finding in a few words: 'critical: straggler rank 5 on node-0001'."""
    return f"{f.severity}: {labels.kind(f.kind, long=True)} – {subject(f)}"


def rates_traces(tokens: Series, mfu: Series, *, legend: bool = True) -> list[go.Scatter]:
    """Tokens/s (first row) and MFU (second row) over steps."""
    return [
        go.Scatter(
            x=tokens.step,
            y=f32(tokens.value),
            name="tokens/s",
            mode="lines",
            line={"color": "#00897b", "width": 1.5},
            showlegend=legend,
            legendgroup="tokens",
            hovertemplate="step %{x}<br>%{y:.4s} tokens/s<extra></extra>",
            xaxis="x",
            yaxis="y",
        ),
        go.Scatter(
            x=mfu.step,
            y=f32(mfu.value),
            name="MFU",
            mode="lines",
            line={"color": "#6d4c41", "width": 1.5},
            showlegend=legend,
            legendgroup="mfu",
            hovertemplate="step %{x}<br>MFU %{y:.1%}<extra></extra>",
            xaxis="x2",
            yaxis="y2",
        ),
    ]


def rates_figure(tokens: Series, mfu: Series, findings: Sequence[Finding] = ()) -> go.Figure:
    """Throughput and MFU over steps, change points (throughput findings) marked."""
    if tokens.step.size == 0 and mfu.step.size == 0:
        return message_figure("No throughput yet: the job reports no tokens or no steps")
    shapes, notes = [], []
    for f in findings:
        if f.kind not in _CHANGE_KINDS or f.first_step is None:
            continue
        color = SEVERITY_COLORS.get(f.severity, "#555")
        label = f"{labels.kind(f.kind, long=True)} {numbers.signed_share(f.effect)}"
        shapes.append(vline(f.first_step, color, "dash"))
        notes.append(
            {"x": f.first_step, "y": 1, "xref": "x", "yref": "paper", "text": text(label),
             "showarrow": False, "xanchor": "left", "yanchor": "bottom", "font": {"color": color}}
        )  # fmt: skip
    if mfu.step.size == 0:
        notes.append(
            {"text": "MFU unknown: no peak FLOP/s or no FLOPs reported", "x": 0.5, "y": 0.2,
             "xref": "paper", "yref": "paper", "showarrow": False}
        )  # fmt: skip
    layout = merged(
        grid_layout(2, 1, shared_xaxes=True, vertical_spacing=0.08),
        {
            **BASE_LAYOUT,
            "height": 380,
            "shapes": shapes,
            "annotations": notes,
            "yaxis": {"title": {"text": "tokens/s"}, "rangemode": "tozero"},
            "yaxis2": {"title": {"text": "MFU"}, "tickformat": ".0%", "rangemode": "tozero"},
            "xaxis2": {"title": {"text": "step"}},
        },
    )
    return go.Figure(data=rates_traces(tokens, mfu), layout=layout)
