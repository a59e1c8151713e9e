"""The per-rank table of a job: each rank's time components against the job's median rank."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import sqlalchemy as sa
from numpy.typing import NDArray

from stepscope.query.common import require_job
from stepscope.query.memo import per_pass
from stepscope.query.mesh import display_order, group_keys, group_starts
from stepscope.store import reads, tables

METRICS = tables.ROLLUP_METRICS
Floats = NDArray[np.float64]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankTable:
    """One entry per rank, slowest first (by median data_s + compute_s: the ranks the others
    wait for). Per time component: `median`, the median over step buckets of the rank's
    bucket means (robust to a few slow steps), and `mean` over all its steps."""

    rank: NDArray[np.int64]
    node: list[str | None]
    median: dict[str, Floats]
    """metric → per rank median of bucket means (s)."""
    mean: dict[str, Floats]
    """metric → per rank mean over its steps (s)."""
    excess_s: dict[str, Floats]
    """metric → per rank `median` minus the median of it over ranks (s)."""
    compute_excess: Floats
    """Relative: compute_s median / the job's median rank's − 1."""
    step_excess: Floats
    """Relative: step_s median / the job's median rank's − 1."""
    slowest_share: Floats
    """Share of the job's rolled-up steps in which this rank had the longest step_s."""
    finding_ids: list[list[int]]
    """Ids of the job's findings naming this rank or its node."""
    bucket_steps: int | None
    """Steps per bucket behind `median`."""


@per_pass
def rank_table(engine: sa.Engine, job_id: str) -> RankTable:
    """Every rank of the job with its time components, excess, slowest share and findings."""
    require_job(engine, job_id)
    stats = [f"{m}_{a}" for m in METRICS for a in ("sum", "count")]
    buckets = reads.read_bucket_matrices(engine, job_id, stats=stats)
    nodes = reads.read_nodes(engine, job_id)
    bucket_ranks = np.empty(0, dtype=np.int64) if buckets is None else buckets.ranks
    ranks = np.union1d(bucket_ranks, np.array(sorted(nodes), dtype=np.int64))
    median: dict[str, Floats] = {}
    mean: dict[str, Floats] = {}
    for m in METRICS:
        median[m] = np.full(ranks.size, np.nan)
        mean[m] = np.full(ranks.size, np.nan)
        if buckets is None:
            continue
        sums, counts = buckets.stats[f"{m}_sum"], buckets.stats[f"{m}_count"]
        at = np.searchsorted(ranks, buckets.ranks)
        with np.errstate(invalid="ignore", divide="ignore"):
            # NaN where a rank has no step in a bucket (count 0 or absent)
            means = sums / counts
            total = np.nansum(counts, axis=0, dtype=np.float64)
            mean[m][at] = np.nansum(sums, axis=0, dtype=np.float64) / total
        median[m][at] = _rank_medians(means)

    excess_s = {m: median[m] - _median(median[m]) for m in METRICS}
    compute_excess = median["compute_s"] / _median(median["compute_s"]) - 1.0
    step_excess = median["step_s"] / _median(median["step_s"]) - 1.0

    slowest, num_steps = reads.slowest_rank_counts(engine, job_id)
    share = np.array([slowest.get(int(r), 0) for r in ranks], dtype=np.float64)
    share = share / num_steps if num_steps else np.full(ranks.size, np.nan)

    ids: dict[int, list[int]] = {int(r): [] for r in ranks}
    for f in reads.read_findings(engine, job_id):
        named = set(f["ranks"] or ()) | {
            r for r, n in nodes.items() if f["node"] and n == f["node"]
        }
        for r in sorted(named & ids.keys()):
            ids[r].append(int(f["id"]))

    own_work = np.nan_to_num(median["data_s"]) + np.nan_to_num(median["compute_s"])
    silent = np.isnan(median["step_s"])
    order = np.lexsort((ranks, -own_work, silent))  # ranks without steps last
    return RankTable(
        rank=ranks[order],
        node=[nodes.get(int(r)) for r in ranks[order]],
        median={m: v[order] for m, v in median.items()},
        mean={m: v[order] for m, v in mean.items()},
        excess_s={m: v[order] for m, v in excess_s.items()},
        compute_excess=compute_excess[order],
        step_excess=step_excess[order],
        slowest_share=share[order],
        finding_ids=[ids[int(r)] for r in ranks[order]],
        bucket_steps=None if buckets is None else buckets.bucket_steps,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RankGroups:
    """The rank table by node or by coordinate of a mesh dimension, slowest group first (by
    median data_s + compute_s). Per time component: `median`, the median over the group's
    ranks of their medians (the group's typical rank), and `max`, its slowest rank's."""

    group_by: str
    group: list[str | None]
    """Each group's node, or its coordinate in the mesh dimension (decimal); None for the
    ranks without one."""
    ranks: list[list[int]]
    """The group's ranks, by node then rank."""
    slowest_rank: NDArray[np.int64]
    """The group's rank of the largest median data_s + compute_s."""
    median: dict[str, Floats]
    """metric → per group median over its ranks of their `RankTable.median` (s)."""
    max: dict[str, Floats]
    """metric → per group max over its ranks of their `RankTable.median` (s)."""
    excess_s: dict[str, Floats]
    """metric → per group `median` minus the median of it over groups (s)."""
    compute_excess: Floats
    """Relative: compute_s median / the median group's − 1."""
    step_excess: Floats
    slowest_share: Floats
    """Share of the job's rolled-up steps in which one of the group's ranks was the slowest."""
    finding_ids: list[list[int]]
    """Ids of the job's findings naming one of the group's ranks or their nodes."""
    bucket_steps: int | None


@per_pass
def rank_groups(engine: sa.Engine, job_id: str, group_by: str) -> RankGroups:
    """The job's ranks grouped by node or a mesh dimension (ValueError for "rank" or a
    dimension the job's mesh does not have), with each group's time components."""
    if group_by == "rank":
        raise ValueError("group_by must be node or a mesh dimension here; rank_table has ranks")
    table = rank_table(engine, job_id)
    nodes = dict(zip(table.rank.tolist(), table.node, strict=True))
    keys = group_keys(engine, job_id, group_by, nodes)
    assert keys is not None
    order = display_order(table.rank.tolist(), nodes, keys)
    bounds = [*group_starts(order, keys).tolist(), len(order)]
    row = {r: i for i, r in enumerate(table.rank.tolist())}
    members = [order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    rows = [np.array([row[r] for r in m], dtype=np.int64) for m in members]
    own_work = np.nan_to_num(table.median["data_s"]) + np.nan_to_num(table.median["compute_s"])

    def over(values: Floats, reduce: str) -> Floats:
        pick = np.nanmedian if reduce == "median" else np.nanmax
        with warnings.catch_warnings():  # "All-NaN slice": a group without steps is NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.array([pick(values[r]) for r in rows], dtype=np.float64)

    median = {m: over(v, "median") for m, v in table.median.items()}
    maximum = {m: over(v, "max") for m, v in table.median.items()}
    excess_s = {m: median[m] - _median(median[m]) for m in METRICS}
    share = np.array(
        [np.nan if np.isnan(table.slowest_share[r]).all() else np.nansum(table.slowest_share[r])
         for r in rows]
    )  # fmt: skip
    group_work = np.nan_to_num(median["data_s"]) + np.nan_to_num(median["compute_s"])
    silent = np.isnan(median["step_s"])
    by = np.lexsort((np.arange(len(rows)), -group_work, silent))
    return RankGroups(
        group_by=group_by,
        group=[_key_text(keys.get(members[i][0])) for i in by],
        ranks=[members[i] for i in by],
        slowest_rank=np.array(
            [members[i][int(np.argmax(own_work[rows[i]]))] for i in by], dtype=np.int64
        ),
        median={m: v[by] for m, v in median.items()},
        max={m: v[by] for m, v in maximum.items()},
        excess_s={m: v[by] for m, v in excess_s.items()},
        compute_excess=(median["compute_s"] / _median(median["compute_s"]) - 1.0)[by],
        step_excess=(median["step_s"] / _median(median["step_s"]) - 1.0)[by],
        slowest_share=share[by],
        finding_ids=[sorted({f for r in rows[i] for f in table.finding_ids[int(r)]}) for i in by],
        bucket_steps=table.bucket_steps,
    )


def _key_text(key: str | int | None) -> str | None:
    return None if key is None else str(key)


def _rank_medians(means: NDArray[np.float32]) -> Floats:
    """Median over buckets (rows) of each rank (column), ignoring NaN."""
    # A full sort along contiguous memory is several times faster than np.median's
    # two-point partition, and sorts NaN last, so each rank's middle is at its count / 2.
    if means.shape[0] == 0:
        return np.full(means.shape[1], np.nan)
    ordered = np.sort(np.ascontiguousarray(means.T), axis=1)
    count = np.count_nonzero(~np.isnan(ordered), axis=1)
    rows = np.arange(ordered.shape[0])
    lower = ordered[rows, np.maximum(count - 1, 0) // 2].astype(np.float64)
    upper = ordered[rows, np.minimum(count // 2, ordered.shape[1] - 1)]
    return np.where(count > 0, (lower + upper) / 2, np.nan)


def _median(values: Floats) -> float:
    present = values[np.isfinite(values)]
    return float(np.median(present)) if present.size else float("nan")
