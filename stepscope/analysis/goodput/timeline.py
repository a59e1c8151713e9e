"""Goodput over time (docs/goodput.md): every GPU-second a category holds is placed in time,
spread evenly over the span it was spent in, so any window's share of it can be read."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl

from stepscope.schema import GOODPUT_CATEGORIES

Floats = np.ndarray[Any, np.dtype[np.float64]]

NICE_WINDOWS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600)
"""Default window lengths, seconds; beyond the last, whole days."""
DEFAULT_NUM_WINDOWS = 100
"""The default window is the shortest nice length giving at most this many windows."""


class Ledger:
    """GPU-seconds per category, each amount spread over [t0, t1] (a point when t0 == t1).

    `unaccounted` is never placed: it is the remainder of a window's GPU-time.
    """

    def __init__(self) -> None:
        self._pieces: dict[str, list[tuple[Floats, Floats, Floats]]] = {}

    def add(self, cats: dict[str, float], category: str, amount: Any, t0: Any, t1: Any) -> None:
        """Add `amount` (GPU-s; scalars or arrays alike) to cats[category], spent in [t0, t1]."""
        a, s, e = np.broadcast_arrays(
            np.asarray(amount, dtype=np.float64),
            np.asarray(t0, dtype=np.float64),
            np.asarray(t1, dtype=np.float64),
        )
        cats[category] += float(a.sum())
        if category != "unaccounted" and a.size:
            self._pieces.setdefault(category, []).append(
                (a.ravel(), s.ravel(), np.maximum(e, s).ravel())
            )

    def placed(self, category: str, edges: Floats) -> Floats:
        """GPU-seconds of `category` in each window [edges[i], edges[i+1])."""
        pieces = self._pieces.get(category)
        if not pieces:
            return np.zeros(max(0, edges.size - 1))
        amount, start, end = (np.concatenate(p) for p in zip(*pieces, strict=True))
        ok = np.isfinite(amount) & np.isfinite(start) & np.isfinite(end) & (amount != 0)
        amount, start, end = amount[ok], start[ok], end[ok]
        cumulative = _spread(amount, start, end, edges)
        return np.diff(cumulative)


def _spread(amount: Floats, start: Floats, end: Floats, at: Floats) -> Floats:
    """Σ of each amount's part spent before each of `at` (ramps over [start, end], points at
    start), by prefix sums over the sorted breakpoints: O((P + W) log P)."""
    ref = float(at[0]) if at.size else 0.0  # near zero: no cancellation in t·Σs − Σs·x
    t = at - ref
    span = end - start
    point = span <= 0
    out = np.zeros(at.shape)
    if point.any():
        x = start[point] - ref
        order = np.argsort(x)
        csum = np.concatenate([[0.0], np.cumsum(amount[point][order])])
        out += csum[np.searchsorted(x[order], t, side="left")]
    ramp = ~point
    if ramp.any():
        slope = amount[ramp] / span[ramp]
        x = np.concatenate([start[ramp], end[ramp]]) - ref
        s = np.concatenate([slope, -slope])
        order = np.argsort(x, kind="stable")
        x, s = x[order], s[order]
        cs = np.concatenate([[0.0], np.cumsum(s)])
        csx = np.concatenate([[0.0], np.cumsum(s * x)])
        i = np.searchsorted(x, t, side="left")
        out += t * cs[i] - csx[i]
    return out


def default_window_s(span_s: float) -> float:
    """The shortest nice window length that cuts `span_s` in at most DEFAULT_NUM_WINDOWS."""
    for w in NICE_WINDOWS_S:
        if span_s / w <= DEFAULT_NUM_WINDOWS:
            return float(w)
    return 86400.0 * math.ceil(span_s / DEFAULT_NUM_WINDOWS / 86400.0)


def window_edges(start: float, end: float, window_s: float) -> Floats:
    """Edges of consecutive windows of `window_s` from `start`, the last one covering `end`."""
    if not (math.isfinite(start) and math.isfinite(end)) or end <= start:
        return np.array([start, start]) if math.isfinite(start) else np.zeros(0)
    count = max(1, math.ceil((end - start) / window_s - 1e-9))
    return start + window_s * np.arange(count + 1, dtype=np.float64)


def windowed(
    ledger: Ledger, edges: Floats, *, num_lanes: int, started_at: float, ended_at: float
) -> pl.DataFrame:
    """Per window: start, end, gpu_s (the job's GPU-time inside it) and every category's
    GPU-seconds (unaccounted: the window's remainder, so a window's categories add up)."""
    if edges.size < 2:
        return pl.DataFrame(
            schema={"start": pl.Float64, "end": pl.Float64, "gpu_s": pl.Float64}
            | dict.fromkeys(GOODPUT_CATEGORIES, pl.Float64)
        )
    lo, hi = edges[:-1], edges[1:]
    inside = np.clip(np.minimum(hi, ended_at) - np.maximum(lo, started_at), 0.0, None)
    columns: dict[str, Floats] = {"start": lo, "end": hi, "gpu_s": num_lanes * inside}
    placed = np.zeros(lo.shape)
    # Nothing is placed outside the job's span: edges beyond it read the same sums, without
    # a far-off edge's rounding (t · Σslope is exact only near the span).
    inner = np.clip(edges, started_at, ended_at)
    for c in GOODPUT_CATEGORIES:
        if c != "unaccounted":
            columns[c] = ledger.placed(c, inner)
            placed = placed + columns[c]
    columns["unaccounted"] = columns["gpu_s"] - placed
    return pl.DataFrame(columns).select("start", "end", "gpu_s", *GOODPUT_CATEGORIES)
