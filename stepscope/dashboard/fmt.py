"""Numbers as the dashboard shows them: short, with units, a dash when unknown."""

from __future__ import annotations

import math
from datetime import UTC, datetime

UNKNOWN = "–"


def known(value: float | None) -> bool:
    """True for a finite number."""
    return value is not None and math.isfinite(value)


def seconds(value: float | None) -> str:
    """A duration: 412 ms, 1.25 s, 3.2 min, 2.1 h."""
    if not known(value):
        return UNKNOWN
    assert value is not None
    if abs(value) < 1.0:
        return f"{value * 1e3:.3g} ms"
    if abs(value) < 120:
        return f"{value:.3g} s"
    if abs(value) < 7200:
        return f"{value / 60:.3g} min"
    return f"{value / 3600:.3g} h"


def share(value: float | None, digits: int = 1) -> str:
    """A fraction as a percentage."""
    return f"{value:.{digits}%}" if known(value) else UNKNOWN


def signed_share(value: float | None) -> str:
    """A relative change: +12.5%, −3.0%."""
    return f"{value:+.1%}".replace("-", "−") if known(value) else UNKNOWN


def rate(value: float | None) -> str:
    """A rate with an SI prefix: 1.23 M."""
    if not known(value):
        return UNKNOWN
    assert value is not None
    for bound, suffix in ((1e12, " T"), (1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(value) >= bound:
            return f"{value / bound:.3g}{suffix}"
    return f"{value:.3g}"


def bytes_per_s(value: float | None) -> str:
    """A bandwidth: 96.5 GB/s."""
    return f"{rate(value)}B/s" if known(value) else UNKNOWN


def size(num_bytes: float | None) -> str:
    """A byte count in binary units: 32 MiB."""
    if not known(num_bytes):
        return UNKNOWN
    assert num_bytes is not None
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def integer(value: int | None) -> str:
    """An integer with thousands separators."""
    return UNKNOWN if value is None else f"{value:,}"


def when(ts: float | None) -> str:
    """An epoch time as UTC date and time."""
    if not known(ts):
        return UNKNOWN
    assert ts is not None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def ago(ts: float | None, now: float) -> str:
    """How long before `now` an epoch time was: 12 s ago."""
    if not known(ts):
        return UNKNOWN
    assert ts is not None
    return f"{seconds(max(now - ts, 0.0))} ago"
