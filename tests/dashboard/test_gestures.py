"""Heatmap gestures: a zoom's step range, a click's rank."""

from __future__ import annotations

from stepscope.dashboard.gestures import clicked_rank, step_range


def test_heatmap_zoom_and_clicks() -> None:
    assert step_range({"xaxis.range[0]": 10.4, "xaxis.range[1]": 99.6}) == (10, 100)
    assert step_range({"xaxis.range": [-5, 20]}) == (0, 21)
    assert step_range({"xaxis.autorange": True}) == (None, None)
    assert step_range({"yaxis.range[0]": 1, "yaxis.range[1]": 2}) is None
    assert clicked_rank({"points": [{"customdata": 7}]}) == 7
    assert clicked_rank({"points": [{"y": "12–15 · node-3"}]}) == 12
    assert clicked_rank({"points": []}) is None
