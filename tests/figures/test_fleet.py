"""The fleet heatmap as a pure function: values in percent, nodes in the list's order."""

from __future__ import annotations

import math

import pytest

from stepscope.figures.fleet import fleet_figure
from stepscope.query.fleet import FleetMap


def test_fleet_figure_draws_each_node_per_time_bin_in_percent() -> None:
    fleet = FleetMap(
        nodes=["slow-<b>1</b>", "ok-2"],
        bin_starts=[1.75e9, 1.75e9 + 3600],
        bin_s=3600.0,
        values=[[0.08, None], [0.001, -0.002]],
        num_jobs=[[3, 0], [1, 2]],
    )
    figure = fleet_figure(fleet)
    [trace] = figure.data
    assert list(trace.y) == ["slow-&lt;b&gt;1&lt;/b&gt;", "ok-2"]  # names are text, not markup
    assert float(trace.z[0][0]) == pytest.approx(8.0)
    assert math.isnan(trace.z[0][1])
    assert float(trace.z[1][1]) == pytest.approx(-0.2)
    assert figure.layout.yaxis.autorange == "reversed"  # the first node on top
    assert trace.zmid == 0.0


def test_an_empty_fleet_says_so() -> None:
    figure = fleet_figure(FleetMap(nodes=[], bin_starts=[], bin_s=0.0, values=[], num_jobs=[]))
    assert not figure.data
    assert figure.layout.title.text == "No node levels stored yet"
