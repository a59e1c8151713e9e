"""The per-rank table of a job: each rank's time components against the job's median rank."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sqlalchemy as sa
from numpy.typing import NDArray

from stepscope.query.common import require_job
from stepscope.query.memo import per_pass
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
