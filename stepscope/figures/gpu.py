"""GPU telemetry over time: util, power, SM clock and temperature, throttling marked."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
from numpy.typing import NDArray

from stepscope.figures.base import (
    BASE_LAYOUT,
    SEVERITY_COLORS,
    axes,
    f32,
    grid_layout,
    merged,
    message_figure,
)
from stepscope.query import GpuSeries
from stepscope.text.labels import throttle_reasons

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
        {**BASE_LAYOUT, "height": 560, "showlegend": True, **panels},
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
        texts = [", ".join(throttle_reasons(int(m))) or f"reasons {int(m):#x}"
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
