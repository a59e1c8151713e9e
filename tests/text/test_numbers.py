"""Numbers read the same in the CLI, the dashboard, the report and the gate."""

from __future__ import annotations

import math

import pytest

from stepscope.text import numbers


@pytest.mark.parametrize("unknown", [None, math.nan, math.inf])
def test_an_unknown_value_prints_as_a_dash_everywhere(unknown: float | None) -> None:
    for show in (
        numbers.seconds,
        numbers.share,
        numbers.signed_share,
        numbers.rate,
        numbers.bytes_per_s,
        numbers.size,
        numbers.when,
    ):
        assert show(unknown) == numbers.UNKNOWN == "–"
    assert numbers.value("step_s", unknown, precise=True) == "–"
    assert numbers.integer(None) == "–"


def test_durations_pick_their_unit() -> None:
    assert [numbers.seconds(v) for v in (0.0004, 0.412, 1.25, 192.0, 9000.0)] == [
        "400 µs",
        "412 ms",
        "1.25 s",
        "3.2 min",
        "2.5 h",
    ]
    assert numbers.seconds(0.41234, digits=4) == "412.3 ms"


def test_a_metric_is_shown_in_the_unit_its_name_says() -> None:
    assert numbers.value("step_s", 0.5) == "500 ms"
    assert numbers.value("tokens_per_s", 12_345.0) == "12.3 k/s"
    assert numbers.value("tokens_per_s", 12_345.0, precise=True) == "12.35 k/s"
    assert numbers.value("busbw_bps", 9.65e10) == "96.5 GB/s"
    assert numbers.value("mfu", 0.4123) == "41.2%"
    assert numbers.value("mfu", 0.4123, precise=True) == "41.23%"
    assert numbers.signed_share(-0.03) == "−3.0%"
    assert numbers.when(0.0) == "1970-01-01 00:00:00 UTC"
    assert numbers.when(0.0, short=True) == "01-01 00:00"
