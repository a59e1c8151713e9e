"""What every chart shares: the template, the palette, the base layout, a make_subplots
grid as a layout dict, and arrays and strings made ready for plotly.

Arrays go into the figures as numpy arrays, so that plotly ≥ 6 sends them as base64 typed
arrays (float32 where the precision is not needed). Every user-provided string (node names,
event messages) is HTML-escaped before plotly sees it: plotly renders a subset of HTML.
"""

from __future__ import annotations

import copy
import functools
import html
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from numpy.typing import NDArray
from plotly.subplots import make_subplots

SEVERITY_COLORS = {"critical": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}
COMPONENT_COLORS = {"data_s": "#8e24aa", "compute_s": "#2e7d32", "comm_wait_s": "#f9a825"}
BAND_COLOR = "#1565c0"
BASELINE_COLOR = "#757575"
"""A baseline job, beside a candidate (the compare page, the CI gate's verdict)."""
CANDIDATE_COLOR = "#1565c0"
HEATMAP_KEEP_BITS = 10
"""Mantissa bits kept in heatmap cells: 0.1% precision, ~1.4 gzipped bytes a cell."""
# The template as plotly's default rather than in each figure's layout, where plotly
# validates a copy of it per figure (~15 ms, a third of building a figure).
# plotly.js hides a tick label that would overflow the graph by default, measuring every
# label's box first (a forced layout each: ~90 ms of a job page's drawing); the margins
# hold the labels, so they are drawn without that check.
_TEMPLATE = go.layout.Template(pio.templates["plotly_white"])
_TEMPLATE.layout.xaxis.ticklabeloverflow = "allow"
_TEMPLATE.layout.yaxis.ticklabeloverflow = "allow"
pio.templates["stepscope"] = _TEMPLATE
pio.templates.default = "stepscope"
LABEL_CHAR_PX = 7
"""Width of a tick label's character (plotly's 12 px font), to fit a margin to labels."""
COLORBAR_PX = 140
"""Right margin that holds a colour bar with its ticks."""
# The margins hold the ticks, axis titles and a legend row above the plot: where a label or
# legend overflows a margin, plotly (automargin) widens it and draws the figure again, which
# doubles its drawing time.
MARGIN = {"l": 70, "r": 30, "t": 70, "b": 60}
BASE_LAYOUT: dict[str, Any] = {
    "margin": MARGIN,
    "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
    "hovermode": "closest",
    "uirevision": "keep",
}


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `extra`, nested dicts merged key by key (as update_layout does)."""
    out = dict(base)
    for key, value in extra.items():
        old = out.get(key)
        out[key] = (
            merged(old, value) if isinstance(value, dict) and isinstance(old, dict) else value
        )
    return out


def grid_layout(rows: int, cols: int, **options: Any) -> dict[str, Any]:
    """The axes (and subplot titles) of a make_subplots grid, as a layout dict to build a
    figure from in one go: make_subplots and update_layout on a built figure take ~0.1 s of
    a job page's ~0.15 s of figures."""
    return copy.deepcopy(_grid(rows, cols, tuple(sorted(options.items()))))


@functools.cache
def _grid(rows: int, cols: int, options: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in options}
    layout: dict[str, Any] = make_subplots(rows=rows, cols=cols, **kwargs).layout.to_plotly_json()
    layout.pop("template", None)  # plotly's default template applies (pio.templates.default)
    return layout


def axes(row: int) -> dict[str, str]:
    """The x and y axis of a one-column grid's row (trace attributes)."""
    suffix = "" if row == 1 else str(row)
    return {"xaxis": f"x{suffix}", "yaxis": f"y{suffix}"}


def text(value: object) -> str:
    """A user string made safe for plotly's HTML-like text rendering."""
    return html.escape(str(value), quote=False)


def f32(values: NDArray[Any]) -> NDArray[np.float32]:
    """Float32 copy of an array (half the bytes of float64 on the wire)."""
    return np.asarray(values, dtype=np.float32)


def round_mantissa(values: NDArray[Any], keep_bits: int = HEATMAP_KEEP_BITS) -> NDArray[np.float32]:
    """Float32 values rounded to `keep_bits` mantissa bits (NaN stays NaN): the zeroed low
    bits compress well, and a colour needs no more precision."""
    drop = 23 - keep_bits
    v = np.ascontiguousarray(values, dtype=np.float32)
    if drop <= 0:
        return v
    bits = v.view(np.uint32)
    rounded = (bits + np.uint32(1 << (drop - 1))) & np.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    return np.where(np.isfinite(v), rounded.view(np.float32), v)


def message_figure(message: str) -> go.Figure:
    """An empty chart that says why it is empty."""
    return go.Figure(
        layout={
            **BASE_LAYOUT,
            "height": 220,
            "xaxis": {"visible": False},
            "yaxis": {"visible": False},
            "annotations": [
                {"text": text(message), "showarrow": False, "xref": "paper", "yref": "paper"}
            ],
        }
    )


def vline(x: float, color: str, dash: str) -> dict[str, Any]:
    """A vertical line at step x over the whole plot height (a layout shape)."""
    return {
        "type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
        "line": {"color": color, "dash": dash, "width": 1.2},
    }  # fmt: skip


def label_margin_px(labels: Sequence[str]) -> int:
    """A left margin that holds these tick labels and the axis title beside them."""
    return 30 + LABEL_CHAR_PX * max((len(label) for label in labels), default=0)


def traces_json(traces: Sequence[go.BaseTraceType]) -> list[dict[str, Any]]:
    """Traces as plotly JSON dicts with typed arrays, for a Patch that appends them."""
    return list(go.Figure(list(traces)).to_plotly_json()["data"])
