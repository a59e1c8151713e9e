"""Downsampling of series over steps that keeps their extremes (MinMaxLTTB, tsdownsample)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray
from tsdownsample import MinMaxLTTBDownsampler

Indices = NDArray[np.int64]
Values = NDArray[np.float64]

_MIN_LTTB_POINTS = 3
"""tsdownsample's LTTB needs at least this many output points."""


def series_indices(x: NDArray[np.int64], y: Values, max_points: int) -> Indices:
    """At most `max_points` sorted indices of (x, y), always those of the global min and max.

    MinMaxLTTB picks the shape (a one-point spike survives: it is the min or max of its
    pre-selection bucket), and the global extremes are added if it left them out. `y` must
    be finite and `x` increasing.
    """
    if x.size <= max_points:  # (also: no argmin of an empty series)
        return np.arange(x.size, dtype=np.int64)
    return _pick(x, [y], [int(np.argmin(y)), int(np.argmax(y))], max_points)


def band_indices(x: NDArray[np.int64], lower: Values, upper: Values, max_points: int) -> Indices:
    """At most `max_points` sorted indices chosen once for a band: its shape from MinMaxLTTB
    on both edges, always with the global min of `lower` and the global max of `upper`."""
    if x.size <= max_points:
        return np.arange(x.size, dtype=np.int64)
    return _pick(x, [upper, lower], [int(np.argmax(upper)), int(np.argmin(lower))], max_points)


def _pick(x: NDArray[np.int64], ys: Sequence[Values], required: list[int], n: int) -> Indices:
    if x.size <= n:
        return np.arange(x.size, dtype=np.int64)
    keep = np.unique(np.array(required, dtype=np.int64))
    # The largest MinMaxLTTB budget whose picks, with the extremes, fit in n points: the
    # series' picks overlap (a band's edges share most steps), so it is often more than n.
    fits, best = n - keep.size, _with_shape(x, ys, keep, n - keep.size)
    over = n * len(ys) + 1
    while over - fits > 1:
        budget = (fits + over) // 2
        chosen = _with_shape(x, ys, keep, budget)
        if chosen.size <= n:
            fits, best = budget, chosen
        else:
            over = budget
    return best


def _with_shape(x: NDArray[np.int64], ys: Sequence[Values], keep: Indices, budget: int) -> Indices:
    """`keep` and MinMaxLTTB's `budget` points shared among `ys`."""
    shares = [budget // len(ys)] * len(ys)
    shares[0] += budget - sum(shares)
    if min(shares) < _MIN_LTTB_POINTS:  # too few points for a shape: the extremes and ends
        ends = [i for i in (0, x.size - 1) if i not in keep][: max(budget, 0)]
        return np.unique(np.concatenate([keep, np.array(ends, dtype=np.int64)]))
    picked = [
        MinMaxLTTBDownsampler().downsample(x, y, n_out=share).astype(np.int64)
        for y, share in zip(ys, shares, strict=True)
    ]
    return np.unique(np.concatenate([keep, *picked]))


def finite(*ys: Values) -> NDArray[np.bool_]:
    """Where every one of `ys` is finite (points without a value are left out of series)."""
    mask = np.ones(ys[0].size, dtype=bool)
    for y in ys:
        mask &= np.isfinite(y)
    return mask
