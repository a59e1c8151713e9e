"""The fleet's chart: nodes × time, each cell a node's excess over its jobs there."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import plotly.graph_objects as go

from stepscope.figures.base import BASE_LAYOUT, COLORBAR_PX, LABEL_CHAR_PX, merged, text
from stepscope.query.fleet import FleetMap


def fleet_figure(fleet: FleetMap) -> go.Figure:
    """A heatmap of each node's mean residual (its excess over its jobs' median, less the
    job's offset) per time bin; red is slow, blank where it ran nothing."""
    if not fleet.nodes:
        return go.Figure(layout=merged(BASE_LAYOUT, {"title": "No node levels stored yet"}))
    z = np.array(
        [[np.nan if v is None else 100.0 * v for v in row] for row in fleet.values],
        dtype=np.float32,
    )
    times = [datetime.fromtimestamp(t, UTC) for t in fleet.bin_starts]
    labels = [text(n) for n in fleet.nodes]
    trace = go.Heatmap(
        z=z,
        x=times,
        y=labels,
        customdata=np.array(fleet.num_jobs),
        colorscale="RdBu_r",
        zmid=0.0,
        zmin=-10.0,
        zmax=10.0,
        colorbar={"title": {"text": "excess %"}},
        hovertemplate="%{y}<br>%{x}<br>%{z:.1f} % over %{customdata} job(s)<extra></extra>",
        hoverongaps=False,
    )
    left = 20 + LABEL_CHAR_PX * max(len(n) for n in fleet.nodes)
    layout = merged(
        BASE_LAYOUT,
        {
            "height": 120 + 18 * len(fleet.nodes),
            "margin": {"l": left, "r": COLORBAR_PX},
            "yaxis": {"autorange": "reversed", "title": None},
            "xaxis": {"title": "jobs started (UTC)"},
        },
    )
    return go.Figure(data=[trace], layout=layout)
