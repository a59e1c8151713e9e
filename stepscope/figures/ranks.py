"""Charts of the ranks: the rank × step heatmap, the per-rank breakdown, one rank's series."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from numpy.typing import NDArray
from plotly.subplots import make_subplots

from stepscope.figures.base import (
    BASE_LAYOUT,
    COLORBAR_PX,
    COMPONENT_COLORS,
    MARGIN,
    f32,
    label_margin_px,
    message_figure,
    round_mantissa,
    text,
    vline,
)
from stepscope.query import Heatmap, RankGroups, RankTable, Series
from stepscope.text import numbers
from stepscope.text.labels import component, mesh_coord, mesh_dim

HEATMAP_SCALE = "Viridis"
MAX_NODE_LINES = 128
"""Node separators are drawn on a heatmap of at most this many nodes."""


def heatmap_labels(hm: Heatmap) -> list[str]:
    """Row labels: 'rank · node', or 'first–last · node' for a row of several ranks; grouped,
    'node-0001 · 8 ranks', 'stage 1 · 4 ranks'."""
    if hm.groups is not None:
        sizes = (hm.row_starts[1:] - hm.row_starts[:-1]).tolist()
        return [
            text(f"{group_label(hm.group_by, g)} · {n} rank{'s' if n != 1 else ''}")
            for g, n in zip(hm.groups, sizes, strict=True)
        ]
    labels = []
    for i, first in enumerate(hm.ranks.tolist()):
        last = int(hm.rank_order[hm.row_starts[i + 1] - 1])
        who = str(first) if last == first else f"{first}–{last}"
        node = hm.nodes[i]
        labels.append(text(f"{who} · {node}" if node else who))
    return labels


def group_label(group_by: str, group: str | None) -> str:
    """A group of ranks: its node ('no node' when unknown), or 'stage 1', 'tp 0'."""
    if group_by == "node":
        return group or "no node"
    return mesh_coord(group_by, group)


def group_axis_title(group_by: str) -> str:
    """The rows' axis title of a chart grouped by `group_by`."""
    return {"rank": "rank · node", "node": "node"}.get(group_by) or mesh_dim(group_by, long=True)


def even_edges(step_edges: NDArray[np.int64]) -> NDArray[np.int64]:
    """Column edges evenly spaced at the first column's width: the last column, which may
    cover fewer steps, is drawn as wide as the others, so that plotly draws the heatmap as
    one image of a pixel per cell (its evenly spaced case; ~5x faster at 1024 x 400 cells)."""
    width = step_edges[1] - step_edges[0]
    return step_edges[0] + np.arange(step_edges.size, dtype=np.int64) * width


def heatmap_trace(hm: Heatmap, labels: Sequence[str] | None = None) -> go.Heatmap:
    """One heatmap trace of a Heatmap (step edges on x, rows on y) on the shared colour axis."""
    unit = "s" if hm.metric.endswith("_s") else ""
    return go.Heatmap(
        x=even_edges(hm.step_edges),
        y=list(labels) if labels is not None else heatmap_labels(hm),
        z=round_mantissa(hm.values),
        coloraxis="coloraxis",
        hovertemplate=f"{'rank ' if hm.groups is None else ''}%{{y}}<br>step %{{x:.0f}}<br>"
        f"{hm.stat} %{{z:.4g}} {unit}<extra></extra>",
    )


def heatmap_figure(hm: Heatmap | None) -> go.Figure:
    """Rank × step heatmap, ranks grouped by node (a line between nodes), or a row per node
    or mesh coordinate (hm.group_by); slowest brightest."""
    if hm is None or hm.values.size == 0:
        return message_figure("No rank buckets yet: the heatmap appears after the first analysis")
    labels = heatmap_labels(hm)
    node_of_row = [n.split("–")[0] if n else None for n in hm.nodes]
    bounds = [i for i in range(1, len(node_of_row)) if node_of_row[i] != node_of_row[i - 1]]
    if hm.groups is not None:  # a row is a group: no node lines
        bounds = []
    shapes = []
    if 0 < len(bounds) <= MAX_NODE_LINES:
        # One path of every line: a shape each costs ~0.3 ms to build, and a path to draw.
        lines = "".join(f"M0,{i - 0.5}H1" for i in bounds)
        shapes.append({"type": "path", "xref": "paper", "yref": "y", "path": lines,
                       "line": {"color": "white", "width": 1}})  # fmt: skip
    rows = len(labels)
    lo, hi = color_range(hm.values)
    layout = {
        **BASE_LAYOUT,
        "margin": {**MARGIN, "l": label_margin_px(labels), "r": COLORBAR_PX, "t": 40},
        "height": int(min(max(300, rows * 6 + 120), 900)),
        "coloraxis": {
            "colorscale": HEATMAP_SCALE,
            "cmin": lo,
            "cmax": hi,
            "colorbar": {
                "title": {"text": _metric_title(hm.metric)},
                "ticklabeloverflow": "allow",
            },
        },
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {
            "title": {"text": group_axis_title(hm.group_by)},
            "autorange": "reversed",
            "type": "category",
        },
    }
    if shapes:
        layout["shapes"] = shapes
    return go.Figure(data=[heatmap_trace(hm, labels)], layout=layout)


def color_range(values: NDArray[Any]) -> tuple[float | None, float | None]:
    """Colour limits that a few extreme cells (warm-up, one-step spikes) do not set: from
    the lowest row's 10th to the highest row's 90th percentile over steps."""
    finite = np.isfinite(values)
    if not finite.any():
        return None, None
    p10, p90 = row_percentiles(values, np.array([10.0, 90.0]))
    lo, hi = float(np.nanmin(p10)), float(np.nanmax(p90))
    if not hi > lo:
        return float(np.nanmin(values)), float(np.nanmax(values))
    return lo, hi


def row_percentiles(values: NDArray[Any], q: NDArray[np.float64]) -> NDArray[np.float64]:
    """(len(q) × rows): the q-th percentiles of each row's non-NaN values (NaN for a row
    without one), as np.nanpercentile(values, q, axis=1) has them, from one sort of the
    rows (nanpercentile sorts each row on its own: ~100 ms for 1024 rows)."""
    ordered = np.sort(values, axis=1)  # NaN last
    last = np.count_nonzero(~np.isnan(values), axis=1) - 1
    at = np.clip(last, 0, None) * (q[:, None] / 100.0)
    below = np.floor(at).astype(np.int64)
    above = np.minimum(below + 1, np.clip(last, 0, None))
    rows = np.arange(values.shape[0])
    lo, hi = ordered[rows, below], ordered[rows, above]
    return np.where(last >= 0, lo + (hi - lo) * (at - below), np.nan)


def _metric_title(metric: str) -> str:
    return f"{component(metric, long=True)} (s)" if metric.endswith("_s") else metric


def breakdown_figure(table: RankTable | RankGroups, *, top: int = 32) -> go.Figure:
    """Per-rank median time components (data / compute / comm wait), slowest first; or per
    group of ranks (a node, a mesh coordinate) its ranks' median, a bar opening its slowest
    rank."""
    have = np.isfinite(table.median["step_s"])
    if not have.any():
        return message_figure("No rank has a rolled-up step yet")
    n = min(top, int(have.sum()))
    if isinstance(table, RankGroups):
        ranks = table.slowest_rank[have][:n]
        rows = [i for i, ok in enumerate(have.tolist()) if ok][:n]
        labels = [
            text(f"{group_label(table.group_by, table.group[i])} · {len(table.ranks[i])} ranks")
            for i in rows
        ]
        hover = "slowest rank %{customdata}<br>median rank %{x:.4g} s<extra>%{fullData.name}"
        axis = group_axis_title(table.group_by)
    else:
        ranks = table.rank[have][:n]
        nodes = [nd for nd, ok in zip(table.node, have.tolist(), strict=True) if ok][:n]
        labels = [
            text(f"{r} · {nd}" if nd else str(r))
            for r, nd in zip(ranks.tolist(), nodes, strict=True)
        ]
        hover = "rank %{customdata}<br>%{x:.4g} s<extra>%{fullData.name}"
        axis = "rank · node"
    bars = [
        go.Bar(
            y=labels,
            x=f32(np.nan_to_num(table.median[metric][have][:n])),
            customdata=ranks,
            name=component(metric),
            orientation="h",
            marker={"color": COMPONENT_COLORS[metric]},
            hovertemplate=hover + "</extra>",
        )
        for metric in ("data_s", "compute_s", "comm_wait_s")
    ]
    median_step = float(np.nanmedian(table.median["step_s"]))
    title = f"median seconds per step (dotted: job median step {numbers.seconds(median_step)})"
    layout = {
        **BASE_LAYOUT,
        "margin": {**MARGIN, "l": label_margin_px(labels)},
        "shapes": [vline(median_step, "#424242", "dot")],
        "barmode": "stack",
        "height": int(min(max(260, n * 18 + 100), 800)),
        "xaxis": {"title": {"text": title}},
        "yaxis": {"autorange": "reversed", "type": "category", "title": {"text": axis}},
    }
    return go.Figure(data=bars, layout=layout)


RANK_PANELS = ("step_s", "compute_s", "data_s", "comm_wait_s")


def rank_figure(rank: int, mine: dict[str, Series], job: dict[str, Series]) -> go.Figure:
    """A rank's time components over steps against the job's median rank."""
    if all(mine[m].step.size == 0 for m in RANK_PANELS if m in mine):
        return message_figure(f"Rank {rank} has no steps yet")
    fig = make_subplots(rows=len(RANK_PANELS), cols=1, shared_xaxes=True, vertical_spacing=0.04)
    for row, metric in enumerate(RANK_PANELS, start=1):
        for series, name, color in ((job.get(metric), "job median rank", "#9e9e9e"),
                                    (mine.get(metric), f"rank {rank}", "#c62828")):  # fmt: skip
            if series is None:
                continue
            fig.add_trace(
                go.Scatter(
                    x=series.step, y=f32(series.value), name=name, mode="lines",
                    line={"color": color, "width": 1.3}, legendgroup=name, showlegend=row == 1,
                    hovertemplate="step %{x}<br>%{y:.4g} s<extra>%{fullData.name}</extra>",
                ),
                row=row,
                col=1,
            )  # fmt: skip
        fig.update_yaxes(title_text=f"{component(metric)} (s)", row=row, col=1)
    fig.update_xaxes(title_text="step", row=len(RANK_PANELS), col=1)
    fig.update_layout(**BASE_LAYOUT, height=620)
    return fig
