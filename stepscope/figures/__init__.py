"""The charts of stepscope, as pure functions: query results in, `go.Figure` out. The
dashboard draws them live and the HTML report embeds them, so a chart looks the same in
both (one palette, one template, one step-time band)."""

from stepscope.figures.base import (
    BAND_COLOR,
    COMPONENT_COLORS,
    SEVERITY_COLORS,
    axes,
    f32,
    grid_layout,
    merged,
    message_figure,
    round_mantissa,
    text,
    traces_json,
    vline,
)
from stepscope.figures.collectives import collective_name, collectives_figure
from stepscope.figures.compare import baseline_levels, components_figure, overlay_figure
from stepscope.figures.goodput import GOODPUT_COLORS, goodput_figure, goodput_time_figure
from stepscope.figures.gpu import GPU_PANELS, gpu_figure, throttled_trace
from stepscope.figures.ranks import (
    RANK_PANELS,
    breakdown_figure,
    color_range,
    group_label,
    heatmap_figure,
    heatmap_labels,
    heatmap_trace,
    rank_figure,
    row_percentiles,
)
from stepscope.figures.steps import (
    Event,
    band_figure,
    band_traces,
    finding_label,
    rates_figure,
    rates_traces,
)

__all__ = [
    "BAND_COLOR",
    "COMPONENT_COLORS",
    "GOODPUT_COLORS",
    "GPU_PANELS",
    "RANK_PANELS",
    "SEVERITY_COLORS",
    "Event",
    "axes",
    "band_figure",
    "band_traces",
    "baseline_levels",
    "breakdown_figure",
    "collective_name",
    "collectives_figure",
    "color_range",
    "components_figure",
    "f32",
    "finding_label",
    "goodput_figure",
    "goodput_time_figure",
    "gpu_figure",
    "grid_layout",
    "group_label",
    "heatmap_figure",
    "heatmap_labels",
    "heatmap_trace",
    "merged",
    "message_figure",
    "overlay_figure",
    "rank_figure",
    "rates_figure",
    "rates_traces",
    "round_mantissa",
    "row_percentiles",
    "text",
    "throttled_trace",
    "traces_json",
    "vline",
]
