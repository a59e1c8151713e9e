"""Level shifts in a per-step series: where the level changed, by how much, and how surely.

Binary segmentation on a spike-clipped copy of the series, pruned bottom-up (as in
Hunter/Otava's split-and-merge) until every change point left is both significant and
large enough:

1. Skip warm-up samples and non-finite values.
2. Noise sigma from the median absolute first difference: a level shift moves a single
   difference and a spike two, so neither inflates it.
3. Clip each value to running median ± `spike_clip_sigmas` sigma; single spikes and short
   bursts (shorter than half the running-median window) stop speaking, level shifts stay.
4. Split a segment where the standardised mean difference (CUSUM) is largest; test it with
   a Welch-type statistic (robust segment scales, variance inflated for lag-1
   autocorrelation) whose two-sided normal p-value is Bonferroni-corrected for the split
   positions scanned. Keep splitting significant segments.
5. Repeatedly drop the weakest change point (least significant, or below `min_effect`,
   measured between segment medians) and re-test its neighbours against their new
   neighbouring segments; then re-locate each survivor within its neighbours.

Cost is O(n) per scanned segment (cumulative sums), a few milliseconds for 10,000 steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

Floats = NDArray[np.float64]

_MAD_TO_SIGMA = 1.482602218505602
"""Scale factor from the median absolute deviation to a normal standard deviation."""


@dataclass(kw_only=True, slots=True)
class ChangePointConfig:
    warmup_steps: int = 20
    """Leading samples ignored (compilation, autotuning, allocator and cache warm-up)."""

    min_effect: float = 0.01
    """Smallest relative change of level reported, |after / before - 1|."""

    min_segment_steps: int = 20
    """Fewest samples on each side of a change point: shorter excursions are not shifts."""

    max_p_value: float = 1e-3
    """Largest p-value reported (two-sided, Bonferroni-corrected over the positions scanned)."""

    max_change_points: int = 10
    """Most change points reported per series (the most significant are kept)."""

    spike_window_steps: int = 7
    """Width of the running median that spikes are clipped against (odd, >= 3)."""

    spike_clip_sigmas: float = 3.0
    """Values further than this many noise sigmas from the running median are clipped."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if self.min_effect < 0:
            raise ValueError("min_effect must be >= 0")
        if self.min_segment_steps < 2:
            raise ValueError("min_segment_steps must be >= 2")
        if not 0 < self.max_p_value < 1:
            raise ValueError("max_p_value must be in (0, 1)")
        if self.max_change_points < 1:
            raise ValueError("max_change_points must be >= 1")
        if self.spike_window_steps < 3 or self.spike_window_steps % 2 == 0:
            raise ValueError("spike_window_steps must be an odd number >= 3")
        if self.spike_clip_sigmas <= 0:
            raise ValueError("spike_clip_sigmas must be > 0")


@dataclass(kw_only=True, slots=True)
class ChangePoint:
    """A level shift: the series is at `before` up to `step` - 1 and at `after` from `step`."""

    step: int
    """First step of the new level."""
    index: int
    """Position of that step in the `values` given to `detect_change_points`."""
    before: float
    """Median of the segment before the change."""
    after: float
    """Median of the segment from the change on."""
    effect: float
    """Relative change, signed: after / before - 1."""
    p_value: float
    """Two-sided p-value, Bonferroni-corrected over the split positions scanned."""
    statistic: float
    """Welch-type standardised difference of the segment means (after - before)."""
    before_steps: int
    """Samples in the segment before the change (up to the previous change point)."""
    after_steps: int
    """Samples in the segment from the change (up to the next change point)."""


def detect_change_points(
    values: ArrayLike, steps: ArrayLike | None = None, *, config: ChangePointConfig
) -> list[ChangePoint]:
    """Level shifts in `values` (ordered by step), in step order."""
    raw = np.asarray(values, dtype=np.float64)
    step_of = np.arange(raw.size) if steps is None else np.asarray(steps)
    if step_of.shape != raw.shape:
        raise ValueError(f"steps has shape {step_of.shape}, values {raw.shape}")
    position = np.arange(raw.size)[config.warmup_steps :]
    finite = np.isfinite(raw[position])
    position = position[finite]
    x = raw[position]
    m = config.min_segment_steps
    if x.size < 2 * m:
        return []

    sigma = _noise_sigma(x)
    y = _clip_spikes(x, sigma, config.spike_window_steps, config.spike_clip_sigmas)
    inflation = _autocorrelation_inflation(y)
    seg = _Segmenter(x=x, y=y, sigma=sigma, inflation=inflation, min_segment=m)

    cuts = seg.binary_segmentation(config.max_p_value, limit=4 * config.max_change_points)
    cuts = seg.prune(cuts, config)
    cuts = seg.relocate(cuts)
    cuts = seg.prune(cuts, config)

    bounds = [0, *cuts, x.size]
    found = []
    for i, cut in enumerate(cuts):
        t = seg.test(bounds[i], cut, bounds[i + 2])
        index = int(position[cut])
        found.append(
            ChangePoint(
                step=int(step_of[index]),
                index=index,
                before=t.before,
                after=t.after,
                effect=t.effect,
                p_value=t.p_value,
                statistic=t.statistic,
                before_steps=cut - bounds[i],
                after_steps=bounds[i + 2] - cut,
            )
        )
    return found


def _noise_sigma(x: Floats) -> float:
    """Robust noise sigma from first differences; never zero for a non-constant series."""
    diffs = np.abs(np.diff(x))
    sigma = _MAD_TO_SIGMA * float(np.median(diffs)) / math.sqrt(2.0)
    if sigma == 0.0:
        # Quantised series (mostly repeated values): fall back on the mean absolute difference.
        sigma = float(np.mean(diffs)) * math.sqrt(math.pi / 2.0) / math.sqrt(2.0)
    # A floor far below any real noise keeps a constant series from dividing by zero.
    return max(sigma, 1e-12 * max(float(np.max(np.abs(x))), 1e-300))


def _clip_spikes(x: Floats, sigma: float, window: int, clip_sigmas: float) -> Floats:
    """`x` clipped to its running median ± `clip_sigmas` sigma."""
    half = window // 2
    padded = np.pad(x, half, mode="edge")
    running_median = np.median(np.lib.stride_tricks.sliding_window_view(padded, window), axis=1)
    bound = clip_sigmas * sigma
    return np.clip(x, running_median - bound, running_median + bound)


@dataclass(kw_only=True, slots=True)
class _Test:
    before: float
    after: float
    effect: float
    p_value: float
    statistic: float


@dataclass(kw_only=True, slots=True)
class _Segmenter:
    x: Floats
    """The series after warm-up (for the reported medians)."""
    y: Floats
    """The spike-clipped series (for locating and testing)."""
    sigma: float
    inflation: float
    """Variance factor of segment means for autocorrelated noise (1 for independent noise)."""
    min_segment: int
    cumsum: Floats | None = None

    def _csum(self) -> Floats:
        if self.cumsum is None:
            self.cumsum = np.concatenate(([0.0], np.cumsum(self.y)))
        return self.cumsum

    def best_split(self, start: int, stop: int) -> int | None:
        """Position in (start, stop) that best separates two means, or None if too short."""
        m = self.min_segment
        if stop - start < 2 * m:
            return None
        c = self._csum()
        k = np.arange(start + m, stop - m + 1)
        left_n = k - start
        right_n = stop - k
        left_mean = (c[k] - c[start]) / left_n
        right_mean = (c[stop] - c[k]) / right_n
        score = np.abs(right_mean - left_mean) / np.sqrt(1.0 / left_n + 1.0 / right_n)
        return int(k[int(np.argmax(score))])

    def test(self, start: int, cut: int, stop: int) -> _Test:
        """Welch-type test of y[start:cut] against y[cut:stop], Bonferroni over the positions."""
        left, right = self.y[start:cut], self.y[cut:stop]
        left_var = max(self.sigma, _robust_sd(left)) ** 2
        right_var = max(self.sigma, _robust_sd(right)) ** 2
        diff = float(right.mean() - left.mean())
        variance = self.inflation * (left_var / left.size + right_var / right.size)
        statistic = diff / math.sqrt(variance)
        positions = max(1, stop - start - 2 * self.min_segment + 1)
        p_value = min(1.0, math.erfc(abs(statistic) / math.sqrt(2.0)) * positions)
        before = float(np.median(self.x[start:cut]))
        after = float(np.median(self.x[cut:stop]))
        effect = after / before - 1.0 if before != 0.0 else math.nan
        return _Test(
            before=before, after=after, effect=effect, p_value=p_value, statistic=statistic
        )

    def binary_segmentation(self, max_p_value: float, *, limit: int) -> list[int]:
        """Cut positions found by splitting segments while the split is significant."""
        cuts: list[int] = []
        pending = [(0, self.x.size)]
        while pending and len(cuts) < limit:
            start, stop = pending.pop()
            cut = self.best_split(start, stop)
            if cut is None or self.test(start, cut, stop).p_value > max_p_value:
                continue
            cuts.append(cut)
            pending += [(start, cut), (cut, stop)]
        return sorted(cuts)

    def prune(self, cuts: list[int], config: ChangePointConfig) -> list[int]:
        """Drop the weakest cut until all are significant, large enough and few enough."""
        cuts = list(cuts)
        while cuts:
            bounds = [0, *cuts, self.x.size]
            tests = [self.test(bounds[i], cuts[i], bounds[i + 2]) for i in range(len(cuts))]
            weakest = max(range(len(cuts)), key=lambda i: tests[i].p_value)
            if tests[weakest].p_value <= config.max_p_value:
                weakest = min(range(len(cuts)), key=lambda i: _abs_effect(tests[i]))
                if _abs_effect(tests[weakest]) >= config.min_effect:
                    if len(cuts) <= config.max_change_points:
                        return cuts
                    weakest = min(range(len(cuts)), key=lambda i: abs(tests[i].statistic))
            del cuts[weakest]
        return cuts

    def relocate(self, cuts: list[int]) -> list[int]:
        """Each cut moved to the best split between its neighbours."""
        cuts = list(cuts)
        for i in range(len(cuts)):
            start = cuts[i - 1] if i > 0 else 0
            stop = cuts[i + 1] if i + 1 < len(cuts) else self.x.size
            best = self.best_split(start, stop)
            if best is not None:
                cuts[i] = best
        return cuts


def _abs_effect(test: _Test) -> float:
    return abs(test.effect) if math.isfinite(test.effect) else 0.0


def _autocorrelation_inflation(y: Floats) -> float:
    """Variance factor (1 + rho) / (1 - rho) of a segment mean under lag-1 autocorrelation.

    rho comes from the first differences, whose lag-1 correlation is -(1 - rho) / 2 for an
    AR(1) series: unlike residuals around a segment mean, they do not mistake a level shift
    elsewhere in the segment for autocorrelation. Differences are clipped at 4 robust sigmas
    so that the shifts themselves do not weigh.
    """
    d = np.diff(y)
    centre = float(np.median(d))
    bound = 4.0 * _MAD_TO_SIGMA * float(np.median(np.abs(d - centre)))
    d = np.clip(d, centre - bound, centre + bound) - centre
    denominator = float(np.dot(d, d))
    if d.size < 3 or denominator == 0.0:
        return 1.0
    rho = 1.0 + 2.0 * float(np.dot(d[1:], d[:-1])) / denominator
    rho = min(max(rho, 0.0), 0.95)
    return (1.0 + rho) / (1.0 - rho)


def _robust_sd(v: Floats) -> float:
    return _MAD_TO_SIGMA * float(np.median(np.abs(v - np.median(v))))
