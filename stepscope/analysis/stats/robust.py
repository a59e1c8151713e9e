"""Robust statistics shared by the detectors: a standard deviation from the median absolute
deviation, which a few outliers do not move."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

MAD_TO_SIGMA = 1.482602218505602
"""Scale factor from the median absolute deviation to a normal standard deviation."""


def mad_sigma(values: ArrayLike, centre: float | None = None) -> float:
    """The normal-equivalent standard deviation of `values` from their median absolute
    deviation about `centre` (their median when not given)."""
    x = np.asarray(values)
    if centre is None:
        centre = float(np.median(x))
    return MAD_TO_SIGMA * float(np.median(np.abs(x - centre)))
