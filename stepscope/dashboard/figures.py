"""The dashboard's charts as pure functions: query results in, `go.Figure` out.

Arrays go into the figures as numpy arrays, so that plotly ≥ 6 sends them as base64 typed
arrays (float32 where the precision is not needed). Every user-provided string (node names,
event messages) is HTML-escaped before plotly sees it: plotly renders a subset of HTML.
"""

from __future__ import annotations

import copy
import functools
import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from numpy.typing import NDArray
from plotly.subplots import make_subplots

from stepscope.dashboard import fmt, words
from stepscope.query import Band, CollectiveStats, GpuSeries, Heatmap, RankTable, Series
from stepscope.schema import Finding

SEVERITY_COLORS = {"critical": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}
COMPONENT_COLORS = {"data_s": "#8e24aa", "compute_s": "#2e7d32", "comm_wait_s": "#f9a825"}
COMPONENT_NAMES = {"data_s": "data", "compute_s": "compute", "comm_wait_s": "comm wait"}
BAND_COLOR = "#1565c0"
HEATMAP_SCALE = "Viridis"
HEATMAP_KEEP_BITS = 10
"""Mantissa bits kept in heatmap cells: 0.1% precision, ~1.4 gzipped bytes a cell."""
MAX_NODE_LINES = 128
"""Node separators are drawn on a heatmap of at most this many nodes."""
_CHANGE_KINDS = ("throughput_drop", "throughput_gain", "mfu_low")
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
_MARGIN = {"l": 70, "r": 30, "t": 70, "b": 60}
_BASE_LAYOUT: dict[str, Any] = {
    "margin": _MARGIN,
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """A job event placed on the step axis."""

    step: float
    kind: str
    rank: int
    message: str | None


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
            **_BASE_LAYOUT,
            "height": 220,
            "xaxis": {"visible": False},
            "yaxis": {"visible": False},
            "annotations": [
                {"text": text(message), "showarrow": False, "xref": "paper", "yref": "paper"}
            ],
        }
    )


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
        **_BASE_LAYOUT,
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


def vline(x: float, color: str, dash: str) -> dict[str, Any]:
    """A vertical line at step x over the whole plot height (a layout shape)."""
    return {
        "type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
        "line": {"color": color, "dash": dash, "width": 1.2},
    }  # fmt: skip


def finding_label(f: Finding) -> str:
    """A finding in a few words: 'critical: straggler rank 5 on node-0001'."""
    return f"{f.severity}: {words.KINDS.get(f.kind, f.kind)} – {words.subject(f)}"


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
        label = f"{words.KINDS.get(f.kind, f.kind)} {fmt.signed_share(f.effect)}"
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
            **_BASE_LAYOUT,
            "height": 380,
            "shapes": shapes,
            "annotations": notes,
            "yaxis": {"title": {"text": "tokens/s"}, "rangemode": "tozero"},
            "yaxis2": {"title": {"text": "MFU"}, "tickformat": ".0%", "rangemode": "tozero"},
            "xaxis2": {"title": {"text": "step"}},
        },
    )
    return go.Figure(data=rates_traces(tokens, mfu), layout=layout)


def label_margin_px(labels: Sequence[str]) -> int:
    """A left margin that holds these tick labels and the axis title beside them."""
    return 30 + LABEL_CHAR_PX * max((len(label) for label in labels), default=0)


def heatmap_labels(hm: Heatmap) -> list[str]:
    """Row labels: 'rank · node', or 'first–last · node' for a row of several ranks."""
    labels = []
    for i, first in enumerate(hm.ranks.tolist()):
        last = int(hm.rank_order[hm.row_starts[i + 1] - 1])
        who = str(first) if last == first else f"{first}–{last}"
        node = hm.nodes[i]
        labels.append(text(f"{who} · {node}" if node else who))
    return labels


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
        hovertemplate=f"rank %{{y}}<br>step %{{x:.0f}}<br>{hm.stat} %{{z:.4g}} {unit}"
        "<extra></extra>",
    )


def heatmap_figure(hm: Heatmap | None) -> go.Figure:
    """Rank × step heatmap, ranks grouped by node (a line between nodes), slowest brightest."""
    if hm is None or hm.values.size == 0:
        return message_figure("No rank buckets yet: the heatmap appears after the first analysis")
    labels = heatmap_labels(hm)
    node_of_row = [n.split("–")[0] if n else None for n in hm.nodes]
    bounds = [i for i in range(1, len(node_of_row)) if node_of_row[i] != node_of_row[i - 1]]
    shapes = []
    if 0 < len(bounds) <= MAX_NODE_LINES:
        # One path of every line: a shape each costs ~0.3 ms to build, and a path to draw.
        lines = "".join(f"M0,{i - 0.5}H1" for i in bounds)
        shapes.append({"type": "path", "xref": "paper", "yref": "y", "path": lines,
                       "line": {"color": "white", "width": 1}})  # fmt: skip
    rows = len(labels)
    lo, hi = color_range(hm.values)
    layout = {
        **_BASE_LAYOUT,
        "margin": {**_MARGIN, "l": label_margin_px(labels), "r": COLORBAR_PX, "t": 40},
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
        "yaxis": {"title": {"text": "rank · node"}, "autorange": "reversed", "type": "category"},
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
    return f"{words.COMPONENTS.get(metric, metric)} (s)" if metric.endswith("_s") else metric


def breakdown_figure(table: RankTable, *, top: int = 32) -> go.Figure:
    """Per-rank median time components (data / compute / comm wait), slowest first."""
    have = np.isfinite(table.median["step_s"])
    if not have.any():
        return message_figure("No rank has a rolled-up step yet")
    n = min(top, int(have.sum()))
    ranks = table.rank[have][:n]
    nodes = [nd for nd, ok in zip(table.node, have.tolist(), strict=True) if ok][:n]
    labels = [
        text(f"{r} · {nd}" if nd else str(r)) for r, nd in zip(ranks.tolist(), nodes, strict=True)
    ]
    bars = [
        go.Bar(
            y=labels,
            x=f32(np.nan_to_num(table.median[metric][have][:n])),
            customdata=ranks,
            name=COMPONENT_NAMES[metric],
            orientation="h",
            marker={"color": COMPONENT_COLORS[metric]},
            hovertemplate="rank %{customdata}<br>%{x:.4g} s<extra>%{fullData.name}</extra>",
        )
        for metric in ("data_s", "compute_s", "comm_wait_s")
    ]
    median_step = float(np.nanmedian(table.median["step_s"]))
    title = f"median seconds per step (dotted: job median step {fmt.seconds(median_step)})"
    layout = {
        **_BASE_LAYOUT,
        "margin": {**_MARGIN, "l": label_margin_px(labels)},
        "shapes": [vline(median_step, "#424242", "dot")],
        "barmode": "stack",
        "height": int(min(max(260, n * 18 + 100), 800)),
        "xaxis": {"title": {"text": title}},
        "yaxis": {"autorange": "reversed", "type": "category", "title": {"text": "rank · node"}},
    }
    return go.Figure(data=bars, layout=layout)


def collectives_figure(stats: CollectiveStats) -> go.Figure:
    """Bus bandwidth per op by message size (left) and per op over steps (right)."""
    if not stats.sizes.op and not stats.series:
        return message_figure("No collectives reported")
    traces: list[go.Bar | go.Scatter] = []
    s = stats.sizes
    for op in dict.fromkeys(s.op):
        at = np.array([o == op for o in s.op])
        sizes = ["no bytes" if k < 0 else f"≥ {fmt.size(2.0**k)}" for k in s.size_log2[at].tolist()]
        traces.append(
            go.Bar(
                x=sizes,
                y=f32(s.busbw_p50_bps[at]),
                name=text(op),
                legendgroup=op,
                customdata=s.num_steps[at],
                hovertemplate="%{x}<br>%{y:.3s}B/s<br>%{customdata} steps<extra>"
                + text(op)
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
                    name=text(f"{series.op} ({label})"),
                    legendgroup=series.op,
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
            **_BASE_LAYOUT,
            "legend": {**_BASE_LAYOUT["legend"], "y": 1.12},
            "margin": {**_MARGIN, "l": 90, "t": 110},  # subplot titles under the legend
            "height": 380,
            "barmode": "group",
            "yaxis": busbw,
            "yaxis2": busbw,
            "xaxis2": {"title": {"text": "step"}},
        },
    )
    return go.Figure(data=traces, layout=layout)


GPU_PANELS = (
    ("util", "util (%)"),
    ("power_w", "power (W)"),
    ("sm_clock_mhz", "SM clock (MHz)"),
    ("temp_c", "temperature (°C)"),
)


def gpu_figure(gpu: GpuSeries | None) -> go.Figure:
    """GPU telemetry over time: util, power, SM clock, temperature; throttling marked.

    Across the job's devices: median with a min–max band; for one rank: a line per device.
    """
    if gpu is None or gpu.ts.size == 0:
        return message_figure("No GPU telemetry: the job sent no GPU samples")
    # Epoch milliseconds on a date axis: a typed array, where datetimes go as a string each.
    when = np.asarray(gpu.ts, dtype=np.float64) * 1e3
    traces: list[go.Scatter] = []
    for row, (metric, _title) in enumerate(GPU_PANELS, start=1):
        if gpu.rank is None:
            traces += _spread_traces(row, when, gpu, metric)
        else:
            traces += _device_traces(row, when, gpu, metric)
    if (gpu.throttle_reasons != 0).any():
        clock = gpu.values["sm_clock_mhz_p50" if gpu.rank is None else "sm_clock_mhz"]
        device = np.zeros(when.size, dtype=np.int64) if gpu.gpu_index is None else gpu.gpu_index
        traces.append(
            throttled_trace(when, clock, gpu.throttle_reasons, device, gpu.bucket_s * 1e3)
        )
    panels: dict[str, Any] = {}
    for row, (_metric, title) in enumerate(GPU_PANELS, start=1):
        x, y = (name.replace("x", "xaxis").replace("y", "yaxis") for name in axes(row).values())
        panels[x] = {"type": "date"}
        panels[y] = {"title": {"text": title}}
    layout = merged(
        grid_layout(len(GPU_PANELS), 1, shared_xaxes=True, vertical_spacing=0.04),
        {**_BASE_LAYOUT, "height": 560, "showlegend": True, **panels},
    )
    return go.Figure(data=traces, layout=layout)


def throttled_trace(
    when_ms: NDArray[Any],
    clock_mhz: NDArray[Any],
    reasons: NDArray[np.int64],
    device: NDArray[np.int64],
    bucket_ms: float,
) -> go.Scatter:
    """The SM clock line drawn over each run of a device's consecutive throttled buckets, to
    the run's last bucket's end, its reasons in words on hover. One path of every run: a
    marker per throttled bucket (~1,000 at 1,024 GPUs, where some device always throttles)
    cost a third of the GPU panels' drawing."""
    order = np.lexsort((when_ms, device))
    when, clock, mask, dev = when_ms[order], clock_mhz[order], reasons[order], device[order]
    throttled = np.flatnonzero(mask != 0)
    breaks = np.flatnonzero(
        (np.diff(throttled) != 1)
        | (dev[throttled[1:]] != dev[throttled[:-1]])
        | ~np.isclose(np.diff(when[throttled]), bucket_ms)
    )
    x: list[float | None] = []
    y: list[float | None] = []
    hover: list[str | None] = []
    for run in np.split(throttled, breaks + 1):
        texts = [", ".join(words.throttle_reasons(int(m))) or f"reasons {int(m):#x}"
                 for m in mask[run].tolist()]  # fmt: skip
        last = int(run[-1])
        x += [*when[run].tolist(), float(when[last] + bucket_ms), None]
        y += [*clock[run].tolist(), float(clock[last]), None]
        hover += [*texts, texts[-1], None]
    return go.Scatter(
        x=x, y=y, mode="lines", name="throttled", hovertext=hover,
        line={"color": SEVERITY_COLORS["critical"], "width": 3},
        hovertemplate="%{x}<br>%{hovertext}<extra>throttled</extra>", **axes(3),
    )  # fmt: skip


def _spread_traces(row: int, when: NDArray[Any], gpu: GpuSeries, metric: str) -> list[go.Scatter]:
    lo, mid, hi = (gpu.values.get(f"{metric}_{q}") for q in ("min", "p50", "max"))
    if mid is None or lo is None or hi is None:
        return []
    legend = row == 1
    return [
        go.Scatter(
            x=when, y=f32(values), name=name, mode="lines", legendgroup=name,
            hovertemplate="%{x}<br>%{y:.4g}<extra>%{fullData.name}</extra>", **axes(row), **extra,
        )
        for values, name, extra in (
            (lo, "min", {"line": {"width": 0}, "showlegend": False}),
            (hi, "min–max across devices", {"line": {"width": 0}, "fill": "tonexty",
                                            "fillcolor": "rgba(0,0,0,0.12)", "showlegend": legend}),
            (mid, "median device", {"line": {"color": "#37474f", "width": 1.3},
                                    "showlegend": legend}),
        )
    ]  # fmt: skip


def _device_traces(row: int, when: NDArray[Any], gpu: GpuSeries, metric: str) -> list[go.Scatter]:
    values = gpu.values.get(metric)
    if values is None or gpu.gpu_index is None:
        return []
    traces = []
    for device in np.unique(gpu.gpu_index).tolist():
        at = gpu.gpu_index == device
        traces.append(
            go.Scatter(
                x=when[at], y=f32(values[at]), name=f"GPU {device}", mode="lines",
                legendgroup=f"gpu{device}", showlegend=row == 1,
                hovertemplate="%{x}<br>%{y:.4g}<extra>%{fullData.name}</extra>", **axes(row),
            )
        )  # fmt: skip
    return traces


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
        fig.update_yaxes(title_text=f"{COMPONENT_NAMES.get(metric, 'step')} (s)", row=row, col=1)
    fig.update_xaxes(title_text="step", row=len(RANK_PANELS), col=1)
    fig.update_layout(**_BASE_LAYOUT, height=620)
    return fig


def overlay_figure(
    baseline: Series, candidate: Series, *, names: tuple[str, str], title: str, unit: str
) -> go.Figure:
    """Two jobs' series of one metric over steps, overlaid."""
    if baseline.step.size == 0 and candidate.step.size == 0:
        return message_figure(f"Neither job has {title} yet")
    fig = go.Figure()
    for series, name, color in ((baseline, names[0], "#757575"), (candidate, names[1], "#1565c0")):
        fig.add_trace(
            go.Scatter(
                x=series.step, y=f32(series.value), name=text(name), mode="lines",
                line={"color": color, "width": 1.4},
                hovertemplate="step %{x}<br>%{y:.4g} " + unit + "<extra>%{fullData.name}</extra>",
            )
        )  # fmt: skip
    fig.update_layout(
        **_BASE_LAYOUT, height=300, title={"text": text(title), "x": 0},
        xaxis_title="step", yaxis={"title": unit, "rangemode": "tozero"},
    )  # fmt: skip
    return fig


def components_figure(
    components: Sequence[tuple[str, float | None, float | None]], *, names: tuple[str, str]
) -> go.Figure:
    """Seconds per step of each time component, baseline beside candidate."""
    labels = [COMPONENT_NAMES.get(f"{c}_s", c) for c, _, _ in components]
    fig = go.Figure()
    for i, (name, color) in enumerate(((names[0], "#757575"), (names[1], "#1565c0"))):
        values = np.array(
            [np.nan if v[i + 1] is None else v[i + 1] for v in components], dtype=np.float32
        )
        fig.add_trace(
            go.Bar(
                x=labels, y=values, name=text(name), marker={"color": color},
                hovertemplate="%{x}<br>%{y:.4g} s<extra>%{fullData.name}</extra>",
            )
        )  # fmt: skip
    fig.update_layout(
        **_BASE_LAYOUT, barmode="group", height=300, yaxis_title="median seconds per step",
        title={"text": "time components of the step", "x": 0},
    )  # fmt: skip
    return fig


def traces_json(traces: Sequence[go.BaseTraceType]) -> list[dict[str, Any]]:
    """Traces as plotly JSON dicts with typed arrays, for a Patch that appends them."""
    return list(go.Figure(list(traces)).to_plotly_json()["data"])
