"""Level shifts in a per-step series: where the level changed, by how much, and how surely.

Binary segmentation on the ranks of the series, pruned bottom-up (as in Hunter/Otava's
split-and-merge) until every change point left is both significant and large enough:

1. Skip warm-up samples and non-finite values.
2. Replace each value by its rank (ties averaged). A spike is then just the top or bottom
   rank, and a series whose steps mix two levels at random (a job of many ranks where some
   rank stalls in a good share of the steps) is as stationary as its mix: neither moves a
   segment's mean rank more than chance does. Level shifts move it a lot.
3. Split a segment where the standardised difference of mean ranks (CUSUM) is largest;
   test it against the permutation variance of the segment's ranks (the Mann-Whitney test,
   variance inflated for lag-1 autocorrelation), with a two-sided normal p-value
   Bonferroni-corrected for the split positions scanned. Keep splitting significant
   segments; a segment shorter than twice `min_segment_steps` is not split, so single
   spikes and short bursts do not speak.
4. Repeatedly drop the weakest change point (least significant, or below `min_effect`,
   measured between segment medians) and re-test its neighbours against their new
   neighbouring segments. Past `max_change_points`, the smallest jump goes.

Cost is O(n log n) once (the ranks) and O(n) per scanned segment (cumulative sums), a few
milliseconds for 10,000 steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from stepscope.analysis.stats.robust import mad_sigma

Floats = NDArray[np.float64]


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
    """Most change points reported per series (the largest significant ones are kept)."""

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
    """Standardised difference of the segments' mean ranks (after - before)."""
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

    y = _ranks(x)
    seg = _Segmenter(x=x, y=y, inflation=_autocorrelation_inflation(y), min_segment=m)

    cuts = seg.binary_segmentation(config.max_p_value, limit=4 * config.max_change_points)
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


def _ranks(x: Floats) -> Floats:
    """Ranks of `x` scaled to (0, 1), ties given their average rank."""
    order = np.argsort(x, kind="stable")
    ordered = x[order]
    new_value = np.concatenate(([True], ordered[1:] != ordered[:-1]))
    first = np.flatnonzero(new_value)
    last = np.concatenate((first[1:], [x.size])) - 1
    tie_group = np.cumsum(new_value) - 1
    ranks = np.empty(x.size)
    ranks[order] = ((first + last) / 2.0 + 1.0)[tie_group]
    return ranks / (x.size + 1)


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
    """Ranks of `x` (for locating and testing)."""
    inflation: float
    """Variance factor of segment means for autocorrelated noise (1 for independent noise)."""
    min_segment: int
    cumsum: Floats | None = None
    cumsum_sq: Floats | None = None

    def _csum(self) -> Floats:
        if self.cumsum is None:
            self.cumsum = np.concatenate(([0.0], np.cumsum(self.y)))
        return self.cumsum

    def _csum_sq(self) -> Floats:
        if self.cumsum_sq is None:
            self.cumsum_sq = np.concatenate(([0.0], np.cumsum(self.y * self.y)))
        return self.cumsum_sq

    def best_split(self, start: int, stop: int) -> int | None:
        """Position in (start, stop) that best separates two mean ranks, or None if too short."""
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
        """Rank test of y[start:cut] against y[cut:stop], Bonferroni over the positions.

        Under no change the segment's ranks are exchangeable, so the difference of the two
        mean ranks has the permutation variance s² (1/n_left + 1/n_right), s² the variance
        of the segment's ranks: no noise model is assumed.
        """
        c, c2 = self._csum(), self._csum_sq()
        n, left_n, right_n = stop - start, cut - start, stop - cut
        total, total_sq = c[stop] - c[start], c2[stop] - c2[start]
        spread = (total_sq - total * total / n) / (n - 1)
        diff = (c[stop] - c[cut]) / right_n - (c[cut] - c[start]) / left_n
        variance = self.inflation * spread * (1.0 / left_n + 1.0 / right_n)
        # All ranks tied (a constant segment): there is nothing to test.
        statistic = float(diff / math.sqrt(variance)) if spread > 1e-12 else 0.0
        positions = max(1, n - 2 * self.min_segment + 1)
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
                    # Too many: the smallest jump goes. Rank statistics saturate once two
                    # levels stop overlapping, and a segment median mixes the levels of cuts
                    # dropped before, so the jump is measured right at each cut.
                    weakest = min(range(len(cuts)), key=lambda i: self.jump(cuts[i]))
            del cuts[weakest]
        return cuts

    def jump(self, cut: int) -> float:
        """|Relative change| between the medians of `min_segment` samples either side of `cut`."""
        m = self.min_segment
        before = float(np.median(self.x[max(0, cut - m) : cut]))
        after = float(np.median(self.x[cut : cut + m]))
        return abs(after / before - 1.0) if before != 0.0 else 0.0


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
    bound = 4.0 * mad_sigma(d, centre)
    d = np.clip(d, centre - bound, centre + bound) - centre
    denominator = float(np.dot(d, d))
    if d.size < 3 or denominator == 0.0:
        return 1.0
    rho = 1.0 + 2.0 * float(np.dot(d[1:], d[:-1])) / denominator
    rho = min(max(rho, 0.0), 0.95)
    return (1.0 + rho) / (1.0 - rho)
