"""Numbers as stepscope shows them, everywhere: short, with units, "–" when unknown."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import TypeGuard

from stepscope.schema import GOODPUT_METRICS

UNKNOWN = "–"
"""What an unknown value (None, NaN, infinite) prints as."""
_SI = ((1e12, " T"), (1e9, " G"), (1e6, " M"), (1e3, " k"))


def known(value: object) -> TypeGuard[float]:
    """True for a finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def finite(value: object) -> float | None:
    """The value as a float when it is a finite number, else None."""
    return float(value) if known(value) else None


def seconds(value: float | None, digits: int = 3) -> str:
    """A duration: 412 µs, 412 ms, 1.25 s, 3.2 min, 2.1 h (`digits` significant digits)."""
    v = finite(value)
    if v is None:
        return UNKNOWN
    if 0 < abs(v) < 1e-3:
        return f"{v * 1e6:.{digits}g} µs"
    if abs(v) < 1.0:
        return f"{v * 1e3:.{digits}g} ms"
    if abs(v) < 120:
        return f"{v:.{digits}g} s"
    if abs(v) < 7200:
        return f"{v / 60:.{digits}g} min"
    return f"{v / 3600:.{digits}g} h"


def share(value: float | None, digits: int = 1) -> str:
    """A fraction as a percentage: 12.5%."""
    return f"{value:.{digits}%}" if known(value) else UNKNOWN


def signed_share(value: float | None, digits: int = 1) -> str:
    """A relative change: +12.5%, −3.0%."""
    return f"{value:+.{digits}%}".replace("-", "−") if known(value) else UNKNOWN


def rate(value: float | None, digits: int = 3) -> str:
    """A count per something with an SI prefix: 1.23 M."""
    v = finite(value)
    if v is None:
        return UNKNOWN
    for bound, suffix in _SI:
        if abs(v) >= bound:
            return f"{v / bound:.{digits}g}{suffix}"
    return f"{v:.{digits}g}"


def bytes_per_s(value: float | None, digits: int = 3) -> str:
    """A bandwidth: 96.5 GB/s."""
    return f"{rate(value, digits)}B/s" if known(value) else UNKNOWN


def size(num_bytes: float | None) -> str:
    """A byte count in binary units: 32 MiB."""
    v = finite(num_bytes)
    if v is None:
        return UNKNOWN
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024:
            return f"{v:.3g} {unit}"
        v /= 1024
    return f"{v:.3g} TiB"


def integer(value: int | None) -> str:
    """An integer with thousands separators: 12,288."""
    return UNKNOWN if value is None else f"{value:,}"


def value(metric: str | None, number: float | None, *, precise: bool = False) -> str:
    """A metric's value in its unit, told by its name: seconds for `*_s`, a rate for
    `*_per_s`, a bandwidth for `*_bps`, a percentage for `mfu` and the goodput shares.
    `precise` (the CI gate's tables) gives 4 significant digits and percentages to 0.01%."""
    digits = 4 if precise else 3
    metric = metric or ""
    if metric == "mfu" or metric in GOODPUT_METRICS:
        return share(number, 2 if precise else 1)
    if metric.endswith("_per_s"):
        return f"{rate(number, digits)}/s" if known(number) else UNKNOWN
    if metric.endswith("_bps"):
        return bytes_per_s(number, digits)
    if metric.endswith("_s"):
        return seconds(number, digits)
    return rate(number, digits)


def when(ts: float | None, *, short: bool = False) -> str:
    """An epoch time in UTC: 2026-05-01 12:30:00 UTC, or 05-01 12:30 (`short`)."""
    t = finite(ts)
    if t is None:
        return UNKNOWN
    layout = "%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S UTC"
    return datetime.fromtimestamp(t, UTC).strftime(layout)


def ago(ts: float | None, now: float) -> str:
    """How long before `now` an epoch time was: 12 s ago."""
    t = finite(ts)
    return UNKNOWN if t is None else f"{seconds(max(now - t, 0.0))} ago"
