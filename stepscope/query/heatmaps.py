"""Rank × step heatmaps from the rank buckets, re-bucketed on both axes on the server."""

from __future__ import annotations

import base64
import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import sqlalchemy as sa
from numpy.typing import NDArray

from stepscope.query.common import check_at_least, check_choice, require_job
from stepscope.query.memo import per_pass
from stepscope.query.mesh import BY_RANK, GroupKey, display_order, group_keys, group_starts
from stepscope.store import reads, tables
from stepscope.store.rollup_tables import RankBuckets

METRICS = tables.ROLLUP_METRICS
STATS = ("mean", "max")
NULL = 255
"""Quantised value of an empty cell in `Heatmap.encode`."""
_LEVELS = 254

Ints = NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class Heatmap:
    """values[row, col]: a statistic of `metric` over the ranks of a row and the steps of a
    column. With group_by="rank", rows are consecutive ranks in (node, rank) order, so a
    node's ranks sit together; grouped by node or a mesh dimension, a row is a node's ranks
    or the ranks at one coordinate of that dimension (consecutive groups when there are
    more than max_ranks). Row i holds rank_order[row_starts[i]:row_starts[i + 1]]; its
    value is the mean over all its ranks' steps in the cell (stat="mean") or their max."""

    metric: str
    stat: str
    rank_order: Ints
    """Every rank, in display order (by group, then node, then rank)."""
    row_starts: Ints
    """Offset of each row's first rank in rank_order, and len(rank_order) last."""
    ranks: Ints
    """First rank of each row."""
    nodes: list[str | None]
    """Node of each row (first–last node when a row spans nodes)."""
    step_edges: Ints
    """Column j covers steps step_edges[j] <= step < step_edges[j + 1]."""
    values: NDArray[np.float32]
    """(rows × columns); NaN where no step of a cell has a value."""
    group_by: str = BY_RANK
    """rank, node or a mesh dimension."""
    groups: list[str | None] | None = None
    """Each row's group: its node, or its coordinate in the mesh dimension (decimal); None
    for ranks without one, "first–last" for a row of several groups; None with group_by="rank"."""

    def encode(self) -> dict[str, Any]:
        """A compact JSON-ready form: values quantised to uint8 over [lo, hi] (NULL = empty),
        deflated (zlib) and base64-encoded; a value is lo + q / 254 × (hi − lo)."""
        finite = np.isfinite(self.values)
        empty = not finite.any()
        lo = 0.0 if empty else float(np.nanmin(self.values))
        hi = 0.0 if empty else float(np.nanmax(self.values))
        scaled = np.rint((self.values - lo) * (_LEVELS / (hi - lo if hi > lo else 1.0)))
        q = np.where(finite, scaled, NULL).astype(np.uint8)
        single = bool(np.all(self.row_starts[1:] - self.row_starts[:-1] == 1))
        return {
            "metric": self.metric,
            "stat": self.stat,
            "group_by": self.group_by,
            "groups": self.groups,
            "ranks": self.ranks.tolist(),
            "rank_order": None if single else self.rank_order.tolist(),
            "row_starts": None if single else self.row_starts.tolist(),
            "nodes": self.nodes,
            "step_edges": self.step_edges.tolist(),
            "shape": list(self.values.shape),
            "scale": [lo, hi],
            "null": NULL,
            "encoding": "uint8+zlib+base64",
            "values": base64.b64encode(zlib.compress(q.tobytes(), 1)).decode(),
        }


def decode_values(doc: dict[str, Any]) -> NDArray[np.float32]:
    """The (rows × columns) values of an `Heatmap.encode` document, NaN where empty."""
    q = np.frombuffer(zlib.decompress(base64.b64decode(doc["values"])), dtype=np.uint8)
    q = q.reshape(doc["shape"])
    lo, hi = doc["scale"]
    values = (lo + q.astype(np.float64) / _LEVELS * (hi - lo)).astype(np.float32)
    values[q == doc["null"]] = np.nan
    return values


@per_pass
def heatmap(
    engine: sa.Engine,
    job_id: str,
    metric: str = "compute_s",
    *,
    stat: str = "mean",
    group_by: str = BY_RANK,
    max_ranks: int = 1024,
    max_steps: int = 1000,
    from_step: int | None = None,
    to_step: int | None = None,
) -> Heatmap | None:
    """The rank × step heatmap of a job in at most max_ranks × max_steps cells (None before
    its first rollup): means weighted by step counts, or maxima, over each cell's steps and
    ranks; rows of ranks, or of nodes or mesh coordinates (`group_by`).

    Cells are made of whole stored buckets, so a step range widens to bucket edges: a zoom
    is no finer than the analyzer's bucket width (raw steps are keyed by rank first, so a
    step range across all ranks would scan the job's raw rows).
    """
    check_choice("metric", metric, METRICS)
    check_choice("stat", stat, STATS)
    check_at_least("max_ranks", max_ranks, 1)
    check_at_least("max_steps", max_steps, 1)
    require_job(engine, job_id)
    nodes = reads.read_nodes(engine, job_id)
    keys = group_keys(engine, job_id, group_by, nodes)
    names = [f"{metric}_sum", f"{metric}_count"] if stat == "mean" else [f"{metric}_max"]
    buckets = reads.read_bucket_matrices(
        engine, job_id, stats=names, from_step=from_step, to_step=to_step
    )
    if buckets is None:
        return None
    return _grid(buckets, metric, stat, nodes, (group_by, keys), max_ranks, max_steps)


def _grid(
    buckets: RankBuckets,
    metric: str,
    stat: str,
    nodes: dict[int, str | None],
    grouping: tuple[str, dict[int, GroupKey] | None],
    max_ranks: int,
    max_steps: int,
) -> Heatmap:
    width = buckets.bucket_steps
    first = int(buckets.first_steps[0])
    span = (int(buckets.first_steps[-1]) - first) // width + 1
    merge = math.ceil(span / max_steps)
    num_cols = math.ceil(span / merge)
    col = (buckets.first_steps - first) // width // merge
    step_edges = first + np.arange(num_cols + 1, dtype=np.int64) * width * merge
    step_edges[-1] = min(int(step_edges[-1]), int(buckets.first_steps[-1]) + width)

    # Display order: by group, node (ranks without one last), rank; rows of `merge_rows`
    # groups (a group is one rank with group_by="rank").
    group_by, keys = grouping
    order = display_order(buckets.ranks.tolist(), nodes, keys)
    rank_order = np.array(order, dtype=np.int64)
    at = np.searchsorted(buckets.ranks, rank_order)
    same_order = bool(np.array_equal(rank_order, buckets.ranks))
    first_of_group = group_starts(order, keys)
    merge_rows = math.ceil(first_of_group.size / max_ranks)
    row_starts = np.append(first_of_group[::merge_rows], rank_order.size).astype(np.int64)

    def cells(matrix: NDArray[np.float32], reduce: np.ufunc, empty: float) -> NDArray[np.float64]:
        """`matrix` (buckets × ranks) reduced into (rows × columns) with `reduce`."""
        m = matrix.astype(np.float64)
        if empty == 0.0:
            np.nan_to_num(m, copy=False, nan=0.0)
        if not same_order:
            m = m[:, at]
        if merge > 1 or col.size < num_cols:  # (the common case, neither, is a copy less)
            starts = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])
            by_col = np.full((num_cols, m.shape[1]), empty)
            by_col[col[starts]] = reduce.reduceat(m, starts, axis=0)
            m = by_col
        if row_starts.size - 1 < m.shape[1]:
            m = reduce.reduceat(m, row_starts[:-1], axis=1)
        return m.T

    if stat == "mean":
        sums = cells(buckets.stats[f"{metric}_sum"], np.add, 0.0)
        counts = cells(buckets.stats[f"{metric}_count"], np.add, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            values = np.where(counts > 0, sums / counts, np.nan)
    else:
        values = cells(buckets.stats[f"{metric}_max"], np.fmax, np.nan)

    def node_of(i: int) -> str | None:
        first_node = nodes.get(int(rank_order[row_starts[i]]))
        last_node = nodes.get(int(rank_order[row_starts[i + 1] - 1]))
        return first_node if first_node == last_node else f"{first_node}–{last_node}"

    def group_of(i: int) -> str | None:
        assert keys is not None
        first = keys.get(int(rank_order[row_starts[i]]))
        last = keys.get(int(rank_order[row_starts[i + 1] - 1]))
        said = [None if k is None else str(k) for k in (first, last)]
        return said[0] if first == last else f"{said[0]}–{said[1]}"

    return Heatmap(
        metric=metric,
        stat=stat,
        group_by=group_by,
        groups=None if keys is None else [group_of(i) for i in range(row_starts.size - 1)],
        rank_order=rank_order,
        row_starts=row_starts,
        ranks=rank_order[row_starts[:-1]],
        nodes=[node_of(i) for i in range(row_starts.size - 1)],
        step_edges=step_edges,
        values=values.astype(np.float32),
    )
