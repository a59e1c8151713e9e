"""Runs of flagged steps: where they start and stop, and where a slow period really began."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


def runs(mask: NDArray[np.bool_], *, merge_gap: int = 0) -> list[tuple[int, int]]:
    """(first, last) positions of runs of True; runs at most `merge_gap` apart are merged."""
    edges = np.diff(mask.astype(np.int8), prepend=0, append=0)
    starts = np.flatnonzero(edges == 1)
    stops = np.flatnonzero(edges == -1) - 1
    merged: list[tuple[int, int]] = []
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        if merged and a - merged[-1][1] <= merge_gap:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def onset(flags: NDArray[np.bool_], lo: int, hi: int, share: float) -> int:
    """Start in [lo, hi] after which flags are densest above `share` (largest suffix sum)."""
    gain = flags[lo : hi + 1] - share
    suffix = np.cumsum(gain[::-1])[::-1]
    return lo + int(np.argmax(suffix))


def offset(flags: NDArray[np.bool_], lo: int, hi: int, share: float) -> int:
    """End in [lo, hi] up to which flags are densest above `share` (largest prefix sum)."""
    gain = flags[lo : hi + 1] - share
    return lo + int(np.argmax(np.cumsum(gain)))
