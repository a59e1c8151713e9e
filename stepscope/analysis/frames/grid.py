"""Long (rank, step) columns laid out as dense (steps × ranks) float32 matrices."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

Matrix = NDArray[np.float32]
Ints = NDArray[np.int64]


@dataclass(kw_only=True, slots=True)
class Grid:
    """The ranks and steps of a frame, and where each of its rows goes in a matrix."""

    ranks: Ints
    """Sorted distinct ranks: the matrix columns."""
    steps: Ints
    """Sorted distinct steps: the matrix rows."""
    flat: Ints | None
    """Row-major (step, rank) position of each input row; None when rows are already in order."""
    transposed: bool = False
    """Input rows are ordered (rank, step) and complete: reshape and transpose."""

    @classmethod
    def of(cls, rank: Ints, step: Ints) -> Grid:
        """The grid of these (rank, step) rows."""
        ranks = _distinct(rank)
        steps = _distinct(step)
        return cls(ranks=ranks, steps=steps, flat=None).placed(rank, step)[0]

    def placed(self, rank: Ints, step: Ints) -> tuple[Grid, NDArray[np.bool_] | None]:
        """A grid with the same axes for other rows, and which rows fall inside it (None: all)."""
        grid = Grid(ranks=self.ranks, steps=self.steps, flat=None)
        num_ranks, num_steps = self.ranks.size, self.steps.size
        if rank.size == num_ranks * num_steps:
            # The usual layouts, checked in two passes: complete and ordered by (rank, step)
            # or by (step, rank).
            by_rank = rank.reshape(num_ranks, num_steps)
            if np.array_equal(by_rank[:, 0], self.ranks) and np.array_equal(
                step[:num_steps], self.steps
            ):
                if (by_rank == self.ranks[:, None]).all() and (
                    step.reshape(num_ranks, num_steps) == self.steps[None, :]
                ).all():
                    grid.transposed = True
                    return grid, None
            by_step = step.reshape(num_steps, num_ranks)
            if np.array_equal(by_step[:, 0], self.steps) and np.array_equal(
                rank[:num_ranks], self.ranks
            ):
                if (by_step == self.steps[:, None]).all() and (
                    rank.reshape(num_steps, num_ranks) == self.ranks[None, :]
                ).all():
                    return grid, None
        ri, r_ok = _positions(rank, self.ranks)
        si, s_ok = _positions(step, self.steps)
        keep = None if r_ok is None and s_ok is None else _and(r_ok, s_ok)
        if keep is not None:
            ri, si = ri[keep], si[keep]
        grid.flat = si * num_ranks + ri
        return grid, keep

    def row_of(self, rank_index: int, step_index: int) -> int | None:
        """Input row of a (rank, step) position when the rows are in grid order, else None."""
        if self.flat is not None:
            return None
        if self.transposed:
            return rank_index * self.steps.size + step_index
        return step_index * self.ranks.size + rank_index

    @property
    def shape(self) -> tuple[int, int]:
        return (self.steps.size, self.ranks.size)

    def matrix(
        self,
        values: NDArray[np.generic],
        keep: NDArray[np.bool_] | None = None,
        dtype: type[np.floating[Any]] = np.float32,
    ) -> NDArray[Any]:
        """`values` (one per input row) as a (steps, ranks) matrix, NaN where missing."""
        v = values if keep is None else values[keep]
        if self.flat is None:
            v32 = v.astype(dtype, copy=False)
            if self.transposed:
                # A column-major view, not a copy: a rank's steps stay contiguous, and
                # elementwise work over the matrix runs as fast either way.
                return v32.reshape(self.shape[::-1]).T
            return v32.reshape(self.shape)
        out = np.full(self.shape[0] * self.shape[1], np.nan, dtype=dtype)
        out[self.flat] = v
        return out.reshape(self.shape)


def _distinct(values: Ints) -> Ints:
    lo, hi = int(values.min()), int(values.max())
    if hi - lo <= 4 * values.size + 1024:
        present = np.bincount(values - lo, minlength=hi - lo + 1) > 0
        return (np.flatnonzero(present) + lo).astype(np.int64)
    return np.unique(values)


def _positions(values: Ints, axis: Ints) -> tuple[Ints, NDArray[np.bool_] | None]:
    """Index of each value in the sorted `axis`, and which values are on it (None: all)."""
    lo = int(axis[0])
    if int(axis[-1]) - lo + 1 == axis.size:
        index = values - lo
        inside = (index >= 0) & (index < axis.size)
        return index, None if inside.all() else inside
    index = np.clip(np.searchsorted(axis, values), 0, axis.size - 1)
    inside = axis[index] == values
    return index, None if inside.all() else inside


def _and(a: NDArray[np.bool_] | None, b: NDArray[np.bool_] | None) -> NDArray[np.bool_]:
    if a is None:
        assert b is not None
        return b
    return a if b is None else a & b


def rank_median(x: Matrix) -> NDArray[np.float32]:
    """Per step (row): the lower median over ranks, ignoring NaN."""
    num_ranks = x.shape[1]
    if not np.isnan(x).any():
        k = (num_ranks - 1) // 2
        return np.partition(x, k, axis=1)[:, k]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows stay NaN
        return np.nanmedian(x, axis=1).astype(np.float32)


def nanmedian(values: NDArray[np.floating]) -> float:
    """Median ignoring NaN; NaN when there is nothing to take it of."""
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if finite.size else float("nan")


def column_sample(x: Matrix, limit: int = 256) -> Matrix:
    """At most `limit` evenly spaced rank columns of `x` (enough for a robust median)."""
    return x[:, :: max(1, x.shape[1] // limit)]
