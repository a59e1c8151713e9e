"""Where a rank's level against its peers shifts up, and how surely: the straggler test.

The input is one metric's per-step residuals (steps × ranks): each rank's value minus the
median over ranks of that step. A rank is slow over a stretch of steps when its mean
residual there is above its own level elsewhere by a significant margin and by at least a
floor in seconds; or, slow throughout, above the peers by more than the ranks' own spread
and a higher floor (hardware is never quite equal). Significance comes from the data, so
power grows with the steps and shrinks with the noise:

- Noise. Residuals are divided by a per-step scale (the robust spread over ranks, smoothed
  over steps: noisier stretches such as a warm-up weigh less) and by each rank's robust
  sigma (from its first differences, which a level shift barely moves), then clipped
  around the rank's own level nearby (the median of its block of steps), so that spikes
  count little and heavy tails weigh less. A mean of k steps has the standard error
  `long_run / sqrt(k)`, `long_run` from the spread of consecutive batch means pooled over
  ranks: autocorrelated noise gets the wider error it needs.
- Test. Each rank's series is cut by binary segmentation at the largest CUSUM statistic
  (the standardised difference of the means either side of a cut) while it is
  significant: a false-alarm chance of `max_p_value` per segment, Bonferroni-divided over
  ranks and channels, over the positions scanned by Siegmund's approximation.
- Decision. Among a rank's pieces the lowest is its baseline; a piece is slow when it is
  significantly above the baseline by the floor (and at least half the floor above the
  peers), or significantly above the peers beyond the spread of the ranks' levels by the
  higher floor. Adjacent slow pieces are one stretch, from its first step (the cut, or
  Page's CUSUM estimate within a piece) to its last.
- Time to a verdict. A stretch of `min_steps` steps or more is named at the thresholds; a
  shorter one (down to MIN_STRETCH_STEPS) when its statistic passes them times
  sqrt(min_steps / steps): it must gather as much excess (sigmas × steps) as a stretch of
  `min_steps` that just passes, as Page's CUSUM asks. A slowdown large against the noise is
  then named a few steps after it began, a small one after `min_steps`.

Everything is computed from the steps given (a step segment and its context), so a live
analysis of the last segment agrees with an analysis of the whole job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from numpy.typing import NDArray

from stepscope.analysis.stats.robust import MAD_TO_SIGMA, mad_sigma

Floats = NDArray[np.float64]
Ints = NDArray[np.int64]

_CLIP = 2.5
"""Standardised residuals are clipped at this many sigmas (spikes count as this much)."""
_SCALE_STEPS = 25
"""Steps over which the per-step noise scale is smoothed (a rolling median)."""
_SMOOTH_STEPS = 11
"""Steps of the rolling median a slow rank's excess in seconds is measured on."""
_BATCH_STEPS = 20
"""Steps per batch mean in the long-run noise estimate."""
_MIN_SIDE = 10
"""Fewest steps on either side of a cut."""
MIN_STRETCH_STEPS = _MIN_SIDE
"""Fewest steps of a stretch named, however large its slowdown."""
_MAX_CUTS = 8
"""Most cuts per rank's series in one segment."""
_MAX_SCALE_RANKS = 256
"""Ranks the per-step noise scale reads at most (evenly spaced)."""
_MEDIAN_STEPS = 256
"""Steps a per-rank median reads at most (every k-th step of a long segment)."""
_SCAN_STEPS = 4
"""Cuts are first scanned every this many steps, for all ranks at once."""
_SCAN_MARGIN = 0.85
"""Ranks whose coarse scan comes this close to the threshold are segmented exactly."""
_SCREEN = 0.25
"""Share of the floor some block of a rank must exceed for the segment to be tested."""
_PHI = NormalDist()


@dataclass(kw_only=True, slots=True)
class Stretch:
    """Steps first..last (positions) over which one rank was slow."""

    rank_index: int
    first: int
    last: int
    confirmed: int
    """Position from which the steps seen so far confirm it (what a live analysis sees)."""
    statistic: float
    """The test statistic (sigmas) of its slowest piece against its reference."""
    reference: str
    """"own" (its level outside the stretch) or "peers" (the ranks' typical level)."""


@dataclass(kw_only=True, slots=True)
class Thresholds:
    """Significance thresholds (sigmas) for one segment's test."""

    cut: float
    """A cut, or a piece against the rank's own baseline."""
    level: float
    """A piece against the peers."""

    @classmethod
    def of(
        cls, num_steps: int, num_ranks: int, num_channels: int, max_p_value: float
    ) -> Thresholds:
        """Thresholds for a chance of `max_p_value` that some rank of a clean segment passes.

        The ranks and channels are Bonferroni-divided. The scan over cut positions is not
        (it would be about ten times too strict: neighbouring cuts test nearly the same
        thing): the chance that the standardised CUSUM of n steps, cuts at least m steps
        from either end, exceeds b is about b phi(b) log((n - m)^2 / m^2) (Siegmund's
        approximation for the standardised Brownian bridge; a little above the simulated
        chance for discrete steps).
        """
        alpha = max_p_value / max(1, num_ranks * num_channels)
        span = max(num_steps - _MIN_SIDE, _MIN_SIDE + 1) / _MIN_SIDE
        length = 2.0 * math.log(span)
        lo, hi = 1.0, 40.0
        for _ in range(60):  # bisection: b phi(b) decreases for b > 1
            b = 0.5 * (lo + hi)
            if b * _PHI.pdf(b) * length > alpha:
                lo = b
            else:
                hi = b
        return cls(cut=hi, level=_PHI.inv_cdf(1.0 - alpha))


def slow_stretches(
    residual_s: NDArray[np.floating],
    shift_floor_s: Floats,
    offset_floor_s: Floats,
    distinct_floor_s: Floats,
    *,
    min_steps: int,
    thresholds: Thresholds,
    settling_steps: int = 0,
    peers: bool = True,
) -> list[Stretch]:
    """Stretches over which a rank was slow, rank by rank: of `min_steps` steps or more, or
    shorter (down to MIN_STRETCH_STEPS) with a statistic scaled up for their length.

    `residual_s`: (steps × ranks) residuals against the per-step median over ranks, NaN where
    a rank did not report (counted as typical). Per step in seconds, `shift_floor_s` is the
    smallest rise over the rank's own level that counts, `offset_floor_s` the smallest excess
    over the peers of a rank slow throughout (hardware is never quite equal), and
    `distinct_floor_s` the excess over the peers beyond which hardware differences are no
    explanation: such a rank is tested against the noise of its steps alone, not against the
    spread of the ranks' levels (which a few ranks cannot tell apart from a straggler).

    With `settling_steps` > 0 the first step is the job's first after its warm-up, so a rank
    slower there than later may still be warming up: a stretch from the first step is named
    only if it is slower than its peers too (not only than its own later level) and lasts
    past `settling_steps`, or is still going on. With `peers` False (ranks that differ by
    design, as a pipeline's stages) the spread of the ranks' levels says nothing: a rank is
    slow against its peers only beyond `distinct_floor_s`.
    """
    num_steps, num_ranks = residual_s.shape
    if num_steps < 2 * _MIN_SIDE or num_ranks < 2:
        return []
    # Column-major: a rank's steps are contiguous for the per-rank sums and medians.
    e = np.array(residual_s, dtype=np.float32, order="F")
    np.nan_to_num(e, copy=False, nan=0.0)
    # A stretch slow enough has blocks of steps well above the ranks' typical level: without
    # any, the test has nothing to find (most segments of the data and collective channels).
    blocks_s = _block_medians(e, _BATCH_STEPS, repeat=False)
    centre_s = float(np.median(np.median(blocks_s, axis=1)))
    if float(np.max(blocks_s)) - centre_s < _SCREEN * float(np.min(shift_floor_s)):
        return []
    z = _standardised(e)
    sums = np.zeros((num_steps + 1, num_ranks), order="F")
    np.cumsum(z, axis=0, dtype=np.float64, out=sums[1:])
    long_run = _long_run_sigma(sums)
    levels = sums[-1] / num_steps
    centre = float(np.median(levels))
    spread = mad_sigma(levels, centre)
    # The ranks' persistent levels differ by more than the noise of their means: hardware.
    # That spread comes from few ranks: widened by about two standard errors of a MAD.
    tau2 = max(0.0, spread * spread - long_run * long_run / num_steps)
    tau2 *= (1.0 + 2.3 / math.sqrt(num_ranks)) ** 2

    absolute = (levels - centre) / math.sqrt(tau2 + long_run * long_run / num_steps)
    distinct = (levels - centre) / (long_run / math.sqrt(num_steps))
    distinct_floor = _SCREEN * float(np.mean(distinct_floor_s))
    if not peers:
        absolute = np.full(num_ranks, -np.inf)
    candidates = np.flatnonzero(
        (_coarse_scan(sums, long_run) >= _SCAN_MARGIN * thresholds.cut)
        | (absolute >= thresholds.level)
        | ((distinct >= thresholds.level) & (np.max(blocks_s, axis=1) - centre_s >= distinct_floor))
    )
    shift_sums = np.concatenate(([0.0], np.cumsum(shift_floor_s)))
    offset_sums = np.concatenate(([0.0], np.cumsum(offset_floor_s)))
    distinct_sums = np.concatenate(([0.0], np.cumsum(distinct_floor_s)))
    out = []
    for r in candidates.tolist():
        # Levels in seconds from the rolling median: spikes gone, level shifts kept.
        smooth_s = _rolling_median(e[:, r].astype(np.float64), _SMOOTH_STEPS)
        series = _Series(
            sums=sums[:, r],
            sums_s=np.concatenate(([0.0], np.cumsum(smooth_s))),
            shift_sums=shift_sums,
            offset_sums=offset_sums,
            distinct_sums=distinct_sums,
            centre=centre,
            centre_s=centre_s,
            tau2=tau2,
            long_run=long_run,
            thresholds=thresholds,
            settling_steps=settling_steps,
            peers=peers,
        )
        out += series.stretches(r, min_steps)
    return out


def _length_factor(steps: Floats, min_steps: int) -> Floats:
    """How much higher than the thresholds a stretch of `steps` steps must score: 1 from
    `min_steps` on, sqrt(min_steps / steps) below (infinite below MIN_STRETCH_STEPS)."""
    with np.errstate(divide="ignore"):
        factor = np.sqrt(np.maximum(min_steps / steps, 1.0))
    return np.where(steps >= MIN_STRETCH_STEPS, factor, np.inf)


def _standardised(e: NDArray[np.float32]) -> NDArray[np.float32]:
    """Residuals in noise units: over the per-step scale and each rank's own sigma, clipped
    around the rank's own level nearby (spikes go, level shifts stay)."""
    num_steps, num_ranks = e.shape
    sample = np.abs(e[:, :: max(1, num_ranks // _MAX_SCALE_RANKS)])
    middle = sample.shape[1] // 2
    per_step = MAD_TO_SIGMA * np.partition(sample, middle, axis=1)[:, middle]
    scale = _rolling_median(per_step.astype(np.float64), _SCALE_STEPS)
    typical = float(np.median(scale))
    if not typical > 0:
        typical = float(np.max(scale)) if np.max(scale) > 0 else 1.0
    scale32 = np.maximum(scale, 0.1 * typical).astype(np.float32)
    z: NDArray[np.float32] = np.divide(e, scale32[:, None], dtype=np.float32)
    d = np.diff(z, axis=0)[:: max(1, num_steps // _MEDIAN_STEPS)]
    sigma = MAD_TO_SIGMA * _column_medians(np.abs(d - _column_medians(d))) / math.sqrt(2.0)
    sigma = np.maximum(sigma, max(1e-3, 1e-3 * float(np.median(sigma)))).astype(np.float32)
    z /= sigma
    # The rank's own level nearby: the median of its block of steps, which may lie far from
    # its peers'.
    local = _block_medians(z, _BATCH_STEPS)
    z -= local
    np.clip(z, -_CLIP, _CLIP, out=z)
    z += local
    return z


def _block_medians(
    x: NDArray[np.float32], block: int, *, repeat: bool = True
) -> NDArray[np.float32]:
    """Each column's median over consecutive blocks of `block` rows (the last block: the last
    `block` rows), repeated over the block's rows; or, with repeat=False, one row per block
    and rank, transposed: (ranks × blocks)."""
    num_rows, num_columns = x.shape
    full = num_rows // block * block
    rows_first = np.ascontiguousarray(x.T)  # a view for column-major x
    medians = np.empty((num_columns, -(-num_rows // block)), dtype=x.dtype)
    if full:
        blocks = rows_first[:, :full].reshape(num_columns, full // block, block)
        medians[:, : full // block] = np.partition(blocks, block // 2, axis=2)[:, :, block // 2]
    if full < num_rows:
        tail = rows_first[:, max(0, num_rows - block) :]
        medians[:, -1] = np.partition(tail, tail.shape[1] // 2, axis=1)[:, tail.shape[1] // 2]
    if not repeat:
        return medians
    return np.repeat(medians, block, axis=1)[:, :num_rows].T


def _column_medians(x: NDArray[np.floating]) -> NDArray[np.floating]:
    """Each column's (lower) median: one partition, fast on column-major matrices."""
    k = (x.shape[0] - 1) // 2
    return np.partition(x, k, axis=0)[k]


def _rolling_median(x: Floats, width: int) -> Floats:
    """Centred rolling median (shorter windows at the ends)."""
    if x.size <= width:
        return np.full(x.size, float(np.median(x)))
    half = width // 2
    padded = np.concatenate((np.full(half, x[:width].mean()), x, np.full(half, x[-width:].mean())))
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1)
    out = np.median(windows, axis=1)
    # The ends: medians of the first and last windows, not of padding.
    out[:half] = np.median(x[: 2 * half + 1])
    out[-half:] = np.median(x[-(2 * half + 1) :])
    return out


def _long_run_sigma(sums: Floats) -> float:
    """Sigma of z for means of many steps, from its cumulative sums: from differences of
    consecutive batch means (a level shift moves one of them), pooled over ranks by the
    median; 1 with too few batches."""
    num_batches = (sums.shape[0] - 1) // _BATCH_STEPS
    if num_batches < 4:
        return 1.0
    means = np.diff(sums[: num_batches * _BATCH_STEPS + 1 : _BATCH_STEPS], axis=0) / _BATCH_STEPS
    d = np.abs(np.diff(means, axis=0))
    sigma = MAD_TO_SIGMA * float(np.median(d)) / math.sqrt(2.0) * math.sqrt(_BATCH_STEPS)
    return max(sigma, 0.5)


def _coarse_scan(sums: Floats, long_run: float) -> Floats:
    """Per column, the largest |CUSUM statistic| over cuts every _SCAN_STEPS steps: which
    ranks to segment (the exact scan runs on those)."""
    n = sums.shape[0] - 1
    k = np.arange(_MIN_SIDE, n - _MIN_SIDE + 1, _SCAN_STEPS)
    if k.size == 0:
        return np.zeros(sums.shape[1])
    kf = k.astype(np.float64)[:, None]
    # after - before = (k S_n - n S_k) / (k (n - k)), over long_run sqrt(n / (k (n - k))).
    bridge = sums[k] - (kf / n) * sums[n]
    weight = math.sqrt(n) / (long_run * np.sqrt(kf * (n - kf)))
    return np.max(np.abs(bridge) * weight, axis=0)


def _best_cuts(sums: Floats, start: int, stop: int, long_run: float) -> tuple[Ints, Floats]:
    """Per column of `sums` (cumulative sums with a leading 0 row): the cut in (start, stop)
    that best separates two means, and its statistic (after minus before, in sigmas)."""
    k = np.arange(start + _MIN_SIDE, stop - _MIN_SIDE + 1)
    if k.size == 0:
        return np.zeros(sums.shape[1], dtype=np.int64), np.zeros(sums.shape[1])
    left_n = (k - start).astype(np.float64)[:, None]
    right_n = (stop - k).astype(np.float64)[:, None]
    before = (sums[k] - sums[start]) / left_n
    after = (sums[stop] - sums[k]) / right_n
    stat = (after - before) / (long_run * np.sqrt(1.0 / left_n + 1.0 / right_n))
    best = np.argmax(np.abs(stat), axis=0)
    return k[best], stat[best, np.arange(stat.shape[1])]


@dataclass(kw_only=True, slots=True)
class _Piece:
    start: int
    stop: int
    level: float
    """Mean standardised residual."""
    level_s: float
    """Mean residual in seconds (of the rolling median: spikes left out)."""
    shift_floor_s: float
    offset_floor_s: float
    distinct_floor_s: float

    @property
    def n(self) -> int:
        return self.stop - self.start


@dataclass(kw_only=True, slots=True)
class _Series:
    """One rank's cumulative residuals, and what its pieces are compared with."""

    sums: Floats
    sums_s: Floats
    shift_sums: Floats
    offset_sums: Floats
    distinct_sums: Floats
    centre: float
    centre_s: float
    tau2: float
    long_run: float
    thresholds: Thresholds
    settling_steps: int
    peers: bool

    def stretches(self, rank_index: int, min_steps: int) -> list[Stretch]:
        pieces = [self._piece(a, b) for a, b in self._segments()]
        eligible = [p for p in pieces if p.n >= _MIN_SIDE] or pieces
        base = min(eligible, key=lambda p: p.level)
        slow: list[tuple[_Piece, float, str]] = []
        for p in pieces:
            verdict = self._slow(p, base)
            if verdict is not None:
                slow.append((p, *verdict))
        out = []
        i = 0
        while i < len(slow):
            j = i
            while j + 1 < len(slow) and slow[j + 1][0].start == slow[j][0].stop:
                j += 1
            run = slow[i : j + 1]
            first, stop = run[0][0].start, run[-1][0].stop
            if run[0][2] == "peers":
                first = self._onset(first, run[0][0])
            if run[-1][2] == "peers" and stop < self.sums.size - 1:
                stop = self._offset(first, stop, run[-1][0])
            if first == 0 and self.settling_steps and not self._settled(run, stop):
                i = j + 1
                continue
            _, statistic, reference = max(run, key=lambda s: s[1])
            threshold = self.thresholds.cut if reference == "own" else self.thresholds.level
            steps = np.array([stop - first], dtype=np.float64)
            if statistic >= threshold * float(_length_factor(steps, min_steps)[0]):
                out.append(
                    Stretch(
                        rank_index=rank_index,
                        first=first,
                        last=stop - 1,
                        confirmed=self._confirmed(first, stop, base, min_steps),
                        statistic=statistic,
                        reference=reference,
                    )
                )
            i = j + 1
        return out

    def _settled(self, run: list[tuple[_Piece, float, str]], stop: int) -> bool:
        """Whether a run of slow pieces from the first step after the job's warm-up is more
        than the rank's own warm-up going on: slow against its peers, and either still slow
        past `settling_steps` (or at the last step seen) or beyond `distinct_floor_s` (a
        warm-up's tail is a few percent)."""
        lasting = stop >= self.settling_steps or stop == self.sums.size - 1
        return any(
            self._slow_vs_peers(p) is not None
            and (lasting or p.level_s - self.centre_s >= p.distinct_floor_s)
            for p, _, _ in run
        )

    def _segments(self) -> list[tuple[int, int]]:
        """Binary segmentation: cuts kept while significant, at most _MAX_CUTS."""
        n = self.sums.size - 1
        cuts: list[int] = []
        pending = [(0, n)]
        while pending and len(cuts) < _MAX_CUTS:
            a, b = pending.pop()
            if b - a < 2 * _MIN_SIDE:
                continue
            cut, stat = _best_cuts(self.sums[:, None], a, b, self.long_run)
            if abs(float(stat[0])) < self.thresholds.cut:
                continue
            c = int(cut[0])
            cuts.append(c)
            pending += [(a, c), (c, b)]
        bounds = [0, *sorted(cuts), n]
        for i in range(1, len(bounds) - 1):
            bounds[i] = self._refined(bounds[i - 1], bounds[i], bounds[i + 1])
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def _refined(self, before: int, cut: int, after: int) -> int:
        """The cut moved to where the excess in seconds changes most nearby: the clipping
        around block medians blurs a large shift's step to its block's edge."""
        lo, hi = max(before, cut - 2 * _BATCH_STEPS), min(after, cut + 2 * _BATCH_STEPS)
        k = np.arange(max(lo + 1, cut - _BATCH_STEPS), min(hi - 1, cut + _BATCH_STEPS) + 1)
        if k.size == 0:
            return cut
        s = self.sums_s
        left_n, right_n = k - lo, hi - k
        diff = (s[hi] - s[k]) / right_n - (s[k] - s[lo]) / left_n
        score = np.abs(diff) * np.sqrt(left_n * right_n / (hi - lo))
        return int(k[int(np.argmax(score))])

    def _piece(self, a: int, b: int) -> _Piece:
        n = b - a
        return _Piece(
            start=a,
            stop=b,
            level=float(self.sums[b] - self.sums[a]) / n,
            level_s=float(self.sums_s[b] - self.sums_s[a]) / n,
            shift_floor_s=float(self.shift_sums[b] - self.shift_sums[a]) / n,
            offset_floor_s=float(self.offset_sums[b] - self.offset_sums[a]) / n,
            distinct_floor_s=float(self.distinct_sums[b] - self.distinct_sums[a]) / n,
        )

    def _slow(self, p: _Piece, base: _Piece) -> tuple[float, str] | None:
        """(statistic, reference) when piece p is slow, else None."""
        above_peers_s = p.level_s - self.centre_s
        if p is not base and above_peers_s >= 0.5 * p.shift_floor_s:
            stat = (p.level - base.level) / (self.long_run * math.sqrt(1.0 / p.n + 1.0 / base.n))
            if stat >= self.thresholds.cut and p.level_s - base.level_s >= p.shift_floor_s:
                return stat, "own"
        return self._slow_vs_peers(p)

    def _slow_vs_peers(self, p: _Piece) -> tuple[float, str] | None:
        above_peers_s = p.level_s - self.centre_s
        distinct = above_peers_s >= p.distinct_floor_s
        if distinct or (self.peers and above_peers_s >= p.offset_floor_s):
            tau2 = 0.0 if distinct else self.tau2
            stat = (p.level - self.centre) / math.sqrt(tau2 + self.long_run**2 / p.n)
            if stat >= self.thresholds.level:
                return stat, "peers"
        return None

    def _onset(self, first: int, piece: _Piece) -> int:
        """Where in a piece slow against its peers the slowdown began (its level shift too
        small to cut at): the start after which the excess over half the piece's level adds
        up most (Page's CUSUM estimate)."""
        drift = 0.5 * (piece.level + self.centre)
        gain = np.diff(self.sums[first : piece.stop + 1]) - drift
        suffix = np.cumsum(gain[::-1])[::-1]
        return first + int(np.argmax(suffix))

    def _offset(self, first: int, stop: int, piece: _Piece) -> int:
        """Where in such a piece the slowdown ended (exclusive): the mirror of _onset."""
        start = max(first, piece.start)
        drift = 0.5 * (piece.level + self.centre)
        gain = np.diff(self.sums[start : stop + 1]) - drift
        return start + int(np.argmax(np.cumsum(gain))) + 1

    def _confirmed(self, first: int, stop: int, base: _Piece, min_steps: int) -> int:
        """First position from which the steps since `first` alone confirm the stretch (at
        the thresholds scaled for their number, as the stretch itself)."""
        t = np.arange(first + MIN_STRETCH_STEPS, stop + 1)  # exclusive ends
        if t.size == 0:
            return stop - 1
        n = (t - first).astype(np.float64)
        factor = _length_factor(n, min_steps)
        level = (self.sums[t] - self.sums[first]) / n
        level_s = (self.sums_s[t] - self.sums_s[first]) / n
        shift_floor_s = (self.shift_sums[t] - self.shift_sums[first]) / n
        offset_floor_s = (self.offset_sums[t] - self.offset_sums[first]) / n
        distinct_floor_s = (self.distinct_sums[t] - self.distinct_sums[first]) / n
        distinct = level_s - self.centre_s >= distinct_floor_s
        with np.errstate(all="ignore"):
            tau2 = np.where(distinct, 0.0, self.tau2)
            absolute = (level - self.centre) / np.sqrt(tau2 + self.long_run**2 / n)
        ok = (
            (distinct | self.peers)
            & (absolute >= self.thresholds.level * factor)
            & (level_s - self.centre_s >= offset_floor_s)
        )
        if base.stop <= first:
            shift = (level - base.level) / (self.long_run * np.sqrt(1.0 / n + 1.0 / base.n))
            ok |= (
                (shift >= self.thresholds.cut * factor)
                & (level_s - base.level_s >= shift_floor_s)
                & (level_s - self.centre_s >= 0.5 * shift_floor_s)
            )
        hits = np.flatnonzero(ok)
        return int(t[hits[0]]) - 1 if hits.size else stop - 1
