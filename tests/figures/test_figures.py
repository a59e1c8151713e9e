"""The charts: query results in, plotly figures out, values read back."""

from __future__ import annotations

import base64
import gzip
import json
import warnings

import numpy as np
import plotly.io as pio
import pytest

from stepscope import figures
from stepscope.query import (
    Band,
    CollectiveStats,
    GpuSeries,
    Heatmap,
    OpSeries,
    RankGroups,
    RankTable,
    Series,
    SizeStats,
)
from tests.findings import straggler


def _band(n: int = 5) -> Band:
    step = np.arange(n, dtype=np.int64) * 10
    mid = np.linspace(0.5, 0.6, n)
    return Band(metric="step_s", step=step, min=mid - 0.1, p50=mid, max=mid + 0.2, num_steps=n)


def _series(metric: str, values: list[float]) -> Series:
    return Series(
        metric=metric,
        agg=None,
        rank=None,
        step=np.arange(len(values), dtype=np.int64),
        value=np.array(values, dtype=np.float64),
        num_steps=len(values),
    )


def _heatmap(nodes: list[str | None] | None = None) -> Heatmap:
    values = np.array([[1.0, 2.0, np.nan], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=np.float32)
    return Heatmap(
        metric="compute_s",
        stat="mean",
        rank_order=np.array([0, 1, 2], dtype=np.int64),
        row_starts=np.array([0, 1, 2, 3], dtype=np.int64),
        ranks=np.array([0, 1, 2], dtype=np.int64),
        nodes=nodes or ["node-a", "node-a", "node-b"],
        step_edges=np.array([0, 10, 20, 25], dtype=np.int64),
        values=values,
    )


def _wire(fig: object) -> dict[str, object]:
    """The figure as Dash sends it."""
    return json.loads(pio.to_json(fig))  # type: ignore[arg-type]


def test_band_holds_min_median_max_and_marks_findings() -> None:
    band = _band()
    fig = figures.band_figure(band, [straggler()])
    by_name = {t.name: t for t in fig.data}
    np.testing.assert_allclose(by_name["min"].y, band.min, rtol=1e-6)
    np.testing.assert_allclose(by_name["median rank"].y, band.p50, rtol=1e-6)
    np.testing.assert_allclose(by_name["min–max across ranks"].y, band.max, rtol=1e-6)
    assert by_name["min–max across ranks"].fill == "tonexty"
    assert list(by_name["findings"].x) == [20]
    assert "rank 5 on node-0001" in by_name["findings"].hovertext[0]
    assert [s.x0 for s in fig.layout.shapes] == [20]


def test_band_is_sent_as_typed_arrays() -> None:
    wire = _wire(figures.band_figure(_band(2000)))
    first = wire["data"][0]  # type: ignore[index]
    assert first["y"]["dtype"] == "f4"
    assert first["x"]["dtype"] in ("i2", "i4")
    decoded = np.frombuffer(base64.b64decode(first["y"]["bdata"]), dtype=np.float32)
    np.testing.assert_allclose(decoded, _band(2000).min, rtol=1e-6)


def test_events_are_marked_with_their_message_escaped() -> None:
    events = [figures.Event(step=12.0, kind="oom", rank=3, message="<b>out of memory</b>")]
    fig = figures.band_figure(_band(), events=events)
    marks = next(t for t in fig.data if t.name == "events")
    assert list(marks.x) == [12.0]
    assert marks.hovertext[0] == "oom on rank 3: &lt;b&gt;out of memory&lt;/b&gt;"


def test_empty_band_says_so() -> None:
    empty = Band(
        metric="step_s",
        step=np.array([], dtype=np.int64),
        min=np.array([]),
        p50=np.array([]),
        max=np.array([]),
        num_steps=0,
    )
    fig = figures.band_figure(empty)
    assert not fig.data
    assert "No step" in fig.layout.annotations[0].text


def test_rates_mark_change_points() -> None:
    drop = straggler(kind="throughput_drop", ranks=[], node=None, first_step=3, effect=-0.2,
                    metric="tokens_per_s")  # fmt: skip
    fig = figures.rates_figure(
        _series("tokens_per_s", [100.0, 100.0, 100.0, 80.0]),
        _series("mfu", [0.5, 0.5, 0.5, 0.4]),
        [drop, straggler()],
    )
    tokens, mfu = fig.data
    np.testing.assert_allclose(tokens.y, [100, 100, 100, 80])
    np.testing.assert_allclose(mfu.y, [0.5, 0.5, 0.5, 0.4], rtol=1e-6)
    assert mfu.yaxis == "y2"
    assert [s.x0 for s in fig.layout.shapes] == [3]  # the straggler is no change point
    assert "−20.0%" in fig.layout.annotations[0].text


def test_heatmap_rows_are_ranks_by_node_with_values_kept() -> None:
    hm = _heatmap()
    fig = figures.heatmap_figure(hm)
    (trace,) = fig.data
    assert list(trace.y) == ["0 · node-a", "1 · node-a", "2 · node-b"]
    assert list(trace.x) == [0, 10, 20, 30]  # evenly spaced: plotly draws it as one image
    np.testing.assert_allclose(trace.z, hm.values, rtol=2e-3)
    assert np.isnan(trace.z[0, 2])
    assert [s.path for s in fig.layout.shapes] == ["M0,1.5H1"]  # one line between the two nodes
    assert fig.layout.yaxis.autorange == "reversed"


def test_heatmap_colours_ignore_a_few_extreme_cells() -> None:
    values = np.full((8, 100), 0.5, dtype=np.float32)
    values[:, :3] = 3.0  # warm-up
    values[5, 20:] = 0.65  # the straggler
    lo, hi = figures.color_range(values)
    assert lo == pytest.approx(0.5)
    assert hi == pytest.approx(0.65)


def test_row_percentiles_are_numpys_in_one_sort() -> None:
    rng = np.random.default_rng(0)
    values = rng.random((50, 40)).astype(np.float32)
    values[rng.random(values.shape) < 0.2] = np.nan
    values[3] = np.nan  # a row without a value
    q = np.array([10.0, 90.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = np.nanpercentile(values, q, axis=1)
    np.testing.assert_allclose(figures.row_percentiles(values, q), expected, rtol=1e-6)


def test_heatmap_labels_of_merged_rows_and_hostile_node_names() -> None:
    hm = Heatmap(
        metric="step_s",
        stat="max",
        rank_order=np.array([0, 1, 2, 3], dtype=np.int64),
        row_starts=np.array([0, 2, 4], dtype=np.int64),
        ranks=np.array([0, 2], dtype=np.int64),
        nodes=["<img src=x>", None],
        step_edges=np.array([0, 5], dtype=np.int64),
        values=np.ones((2, 1), dtype=np.float32),
    )
    assert figures.heatmap_labels(hm) == ["0–1 · &lt;img src=x&gt;", "2–3"]


def test_mantissa_rounding_keeps_a_thousandth_and_shrinks_the_payload() -> None:
    rng = np.random.default_rng(0)
    values = (0.4 + 0.01 * rng.standard_normal((256, 600))).astype(np.float32)
    values[0, 0] = np.nan
    rounded = figures.round_mantissa(values)
    assert np.isnan(rounded[0, 0])
    np.testing.assert_allclose(rounded[1:], values[1:], rtol=2**-10)

    def gzipped(a: np.ndarray) -> int:
        return len(gzip.compress(base64.b64encode(a.tobytes())))

    assert gzipped(rounded) < 0.5 * gzipped(values)


def test_breakdown_lists_the_slowest_rank_first() -> None:
    ranks = np.array([5, 0, 1], dtype=np.int64)
    median = {
        "step_s": np.array([0.65, 0.5, 0.5]),
        "data_s": np.array([0.01, 0.01, 0.01]),
        "compute_s": np.array([0.62, 0.47, 0.46]),
        "comm_wait_s": np.array([0.02, 0.17, 0.18]),
    }
    table = RankTable(
        rank=ranks,
        node=["n1", "n0", None],
        median=median,
        mean=median,
        excess_s=median,
        compute_excess=np.zeros(3),
        step_excess=np.zeros(3),
        slowest_share=np.zeros(3),
        finding_ids=[[1], [], []],
        bucket_steps=1,
    )
    fig = figures.breakdown_figure(table)
    data, compute, wait = fig.data
    assert list(compute.y) == ["5 · n1", "0 · n0", "1"]
    assert list(compute.customdata) == [5, 0, 1]
    np.testing.assert_allclose(compute.x, [0.62, 0.47, 0.46], rtol=1e-6)
    np.testing.assert_allclose(wait.x, [0.02, 0.17, 0.18], rtol=1e-6)
    assert fig.layout.barmode == "stack"


def test_collectives_show_busbw_by_size_and_over_steps() -> None:
    stats = CollectiveStats(
        sizes=SizeStats(
            group=["all", "all"],
            op=["all_reduce", "all_gather"],
            size_log2=np.array([25, 20], dtype=np.int64),
            num_steps=np.array([100, 50], dtype=np.int64),
            bytes_per_call_p50=np.array([4e7, 1.2e6]),
            busbw_p50_bps=np.array([9e10, 4e10]),
            transfer_busbw_p50_bps=np.array([1e11, 5e10]),
            algbw_p50_bps=np.array([5e10, 2.5e10]),
        ),
        series=[
            OpSeries(
                group="all",
                op="all_reduce",
                step=np.array([0, 1], dtype=np.int64),
                busbw_p50_bps=np.array([9e10, 8e10]),
                busbw_min_bps=np.array([7e10, 6e10]),
            )
        ],
    )
    fig = figures.collectives_figure(stats)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["all_reduce", "all_gather"]
    assert list(bars[0].x) == ["≥ 32 MiB"]
    np.testing.assert_allclose(bars[0].y, [9e10], rtol=1e-6)
    lines = [t for t in fig.data if t.type == "scatter"]
    np.testing.assert_allclose(lines[1].y, [7e10, 6e10], rtol=1e-6)


def test_gpu_panels_mark_throttling_with_reasons_in_words() -> None:
    ts = np.array([1.7e9, 1.7e9 + 1, 1.7e9 + 2])
    values = {f"{m}_{q}": np.array([1.0, 2.0, 3.0]) for m, _ in figures.GPU_PANELS
              for q in ("min", "p50", "max")}  # fmt: skip
    gpu = GpuSeries(
        rank=None,
        bucket_s=1.0,
        ts=ts,
        gpu_index=None,
        num_devices=np.array([8, 8, 8]),
        values=values,
        throttle_reasons=np.array([0, 0x4 | 0x20, 0]),
    )
    fig = figures.gpu_figure(gpu)
    throttled = next(t for t in fig.data if t.name == "throttled")
    # the clock line over the throttled bucket, to the bucket's end
    assert throttled.x == (ts[1] * 1e3, (ts[1] + 1) * 1e3, None)
    assert throttled.y == (2.0, 2.0, None)
    reasons = "software power cap, software thermal slowdown"
    assert throttled.hovertext == (reasons, reasons, None)
    assert len([t for t in fig.data if t.name == "median device"]) == len(figures.GPU_PANELS)
    assert figures.gpu_figure(None).layout.annotations[0].text.startswith("No GPU telemetry")


def test_throttling_is_drawn_as_one_line_per_run_of_a_devices_throttled_buckets() -> None:
    # device 0 throttled in buckets 0-1 (power, then thermal) and 3; device 1 in bucket 1;
    # a gap in device 1's samples ends its run
    when = np.array([0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 3.0]) * 1e3
    device = np.array([0, 0, 0, 0, 1, 1, 1])
    clock = np.array([10.0, 11.0, 12.0, 13.0, 20.0, 21.0, 23.0])
    reasons = np.array([0x4, 0x20, 0, 0x4, 0, 0x4, 0x4])

    trace = figures.throttled_trace(when, clock, reasons, device, 1e3)

    assert trace.x == (0.0, 1e3, 2e3, None, 3e3, 4e3, None, 1e3, 2e3, None, 3e3, 4e3, None)
    assert trace.y == (10.0, 11.0, 11.0, None, 13.0, 13.0, None, 21.0, 21.0, None, 23.0, 23.0, None)
    power, thermal = "software power cap", "software thermal slowdown"
    assert trace.hovertext[:4] == (power, thermal, thermal, None)
    assert trace.mode == "lines"


def test_live_traces_are_json_with_typed_arrays() -> None:
    (low, high, mid) = figures.traces_json(figures.band_traces(_band(), legend=False))
    assert mid["y"]["dtype"] == "f4"
    assert high["fill"] == "tonexty"
    assert not mid["showlegend"]


def test_collectives_are_named_by_group_and_op() -> None:
    stats = CollectiveStats(
        sizes=SizeStats(
            group=["dp", "tp", "tp"],
            op=["all_reduce", "all_gather", "all_gather"],
            size_log2=np.array([25, 19, 20], dtype=np.int64),
            num_steps=np.array([100, 60, 40], dtype=np.int64),
            bytes_per_call_p50=np.array([4e7, 6e5, 1.2e6]),
            busbw_p50_bps=np.array([9e10, 4e10, 5e10]),
            transfer_busbw_p50_bps=np.array([1e11, 5e10, 6e10]),
            algbw_p50_bps=np.array([5e10, 2.5e10, 3e10]),
        ),
        series=[
            OpSeries(
                group=group,
                op=op,
                step=np.array([0, 1], dtype=np.int64),
                busbw_p50_bps=np.array([9e10, 8e10]),
                busbw_min_bps=np.array([7e10, 6e10]),
            )
            for group, op in (("dp", "all_reduce"), ("tp", "all_gather"))
        ],
    )
    fig = figures.collectives_figure(stats)
    bars = [t for t in fig.data if t.type == "bar"]
    lines = [t for t in fig.data if t.type == "scatter"]

    assert [t.name for t in bars] == ["dp all_reduce", "tp all_gather"]
    assert list(bars[1].x) == ["≥ 512 KiB", "≥ 1 MiB"]
    assert [t.name for t in lines] == [
        "dp all_reduce (median rank)",
        "dp all_reduce (slowest rank)",
        "tp all_gather (median rank)",
        "tp all_gather (slowest rank)",
    ]
    assert {t.legendgroup for t in fig.data} == {"dp/all_reduce", "tp/all_gather"}


def test_a_heatmap_by_stage_has_a_row_per_stage_without_node_lines() -> None:
    hm = Heatmap(
        metric="compute_s",
        stat="mean",
        group_by="pp",
        groups=["0", "1"],
        rank_order=np.arange(8, dtype=np.int64),
        row_starts=np.array([0, 4, 8], dtype=np.int64),
        ranks=np.array([0, 4], dtype=np.int64),
        nodes=["node-a", "node-b"],
        step_edges=np.array([0, 10, 20], dtype=np.int64),
        values=np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32),
    )
    fig = figures.heatmap_figure(hm)
    (trace,) = fig.data

    assert list(trace.y) == ["stage 0 · 4 ranks", "stage 1 · 4 ranks"]
    assert fig.layout.yaxis.title.text == "pipeline stage"
    assert not fig.layout.shapes
    assert trace.hovertemplate.startswith("%{y}<br>")
    by_node = Heatmap(**{**{f: getattr(hm, f) for f in Heatmap.__slots__}, "group_by": "node",
                         "groups": ["<b>n</b>", None]})  # fmt: skip
    assert figures.heatmap_labels(by_node) == [
        "&lt;b&gt;n&lt;/b&gt; · 4 ranks",
        "no node · 4 ranks",
    ]


def test_the_breakdown_by_node_draws_each_node_s_median_rank() -> None:
    median = {
        "step_s": np.array([0.6, 0.5, np.nan]),
        "data_s": np.array([0.01, 0.01, np.nan]),
        "compute_s": np.array([0.55, 0.47, np.nan]),
        "comm_wait_s": np.array([0.04, 0.02, np.nan]),
    }
    groups = RankGroups(
        group_by="node",
        group=["n1", "n0", None],
        ranks=[[4, 5, 6, 7], [0, 1, 2, 3], [8]],
        slowest_rank=np.array([5, 2, 8], dtype=np.int64),
        median=median,
        max=median,
        excess_s=median,
        compute_excess=np.zeros(3),
        step_excess=np.zeros(3),
        slowest_share=np.zeros(3),
        finding_ids=[[1], [], []],
        bucket_steps=1,
    )
    fig = figures.breakdown_figure(groups)
    _data, compute, _wait = fig.data

    assert list(compute.y) == ["n1 · 4 ranks", "n0 · 4 ranks"]  # the group without steps left out
    assert list(compute.customdata) == [5, 2]  # a click opens the slowest rank
    np.testing.assert_allclose(compute.x, [0.55, 0.47], rtol=1e-6)
    assert fig.layout.yaxis.title.text == "node"
