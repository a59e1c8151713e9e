"""One job's node and GPU levels: how much longer each physical node's (and GPU's) own work
took than the job's median rank, robustly, with a standard error (docs/fleet.md).

A rank's *own time* per step is its step time less the time it sat blocked on collectives
(data + compute): in synchronous training every rank's step ends together, so only the own
time says who the others waited for. Per step bucket, each rank's mean own time is divided
by the median over ranks of that bucket (which removes the job's own drift); a rank's level
is the median over buckets of the log of that ratio, its standard error the MAD-based one of
a median. A node's level is that of the mean over its ranks, per bucket.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import numpy as np
import polars as pl
from numpy.typing import NDArray

from stepscope.analysis.stats.robust import MAD_TO_SIGMA
from stepscope.schema import compact_ranks

MEDIAN_SE = math.sqrt(math.pi / 2)
"""Standard error of a median of n normal values is this × sigma / sqrt(n)."""
MIN_SE = 1e-4
"""Floor on a level's standard error (log units): no job measures a node exactly."""

LEVEL_SCHEMA = {
    "node": pl.String,
    "gpu": pl.String,
    "ranks": pl.String,
    "num_ranks": pl.Int64,
    "excess": pl.Float64,
    "se": pl.Float64,
    "num_buckets": pl.Int64,
}
"""The columns of `job_levels`: gpu is "" on a node's row; excess and se are in log units."""


def own_time_matrix(
    sums: Mapping[str, NDArray[np.float32]], counts: NDArray[np.float32]
) -> NDArray[np.float64]:
    """(buckets × ranks) mean own time per step (data_s + compute_s), NaN where absent."""
    total = sums["data_s"].astype(np.float64) + sums["compute_s"].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, total / counts, np.nan)


def job_levels(
    own_s: NDArray[np.float64],
    ranks: NDArray[np.int64],
    nodes: Mapping[int, str],
    gpus: Mapping[int, str] | None = None,
) -> pl.DataFrame:
    """Each node's (gpu "") and each known GPU's level in one job: `own_s` is (buckets ×
    ranks) mean own time per step of the ranks in `ranks`; ranks without a node are left out.
    Empty when fewer than two nodes (a level against oneself says nothing)."""
    placed = [i for i, r in enumerate(ranks.tolist()) if nodes.get(int(r))]
    hosts = sorted({nodes[int(ranks[i])] for i in placed})
    if len(hosts) < 2 or own_s.size == 0:
        return pl.DataFrame(schema=LEVEL_SCHEMA)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        logs = np.log(np.where(own_s > 0, own_s, np.nan))
        rel = logs - np.nanmedian(logs, axis=1, keepdims=True)
    rows: list[dict[str, object]] = []
    for host in hosts:
        cols = [i for i in placed if nodes[int(ranks[i])] == host]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            series = np.nanmean(rel[:, cols], axis=1)
        level = _level(series)
        if level is None:
            continue
        members = sorted(int(ranks[i]) for i in cols)
        rows.append(_row(host, "", members, *level))
        for i in cols:
            gpu = (gpus or {}).get(int(ranks[i]))
            rank_level = _level(rel[:, i]) if gpu else None
            if gpu and rank_level is not None:
                rows.append(_row(host, gpu, [int(ranks[i])], *rank_level))
    return pl.DataFrame(rows, schema=LEVEL_SCHEMA, orient="row")


def _level(series: NDArray[np.float64]) -> tuple[float, float, int] | None:
    """(median, its standard error, buckets) of a series' finite values; None if none."""
    x = series[np.isfinite(series)]
    if x.size == 0:
        return None
    centre = float(np.median(x))
    sigma = MAD_TO_SIGMA * float(np.median(np.abs(x - centre)))
    se = MEDIAN_SE * sigma / math.sqrt(x.size) if x.size > 1 else math.inf
    return centre, max(se, MIN_SE), int(x.size)


def _row(
    node: str, gpu: str, ranks: list[int], excess: float, se: float, num_buckets: int
) -> dict[str, object]:
    return {
        "node": node,
        "gpu": gpu,
        "ranks": compact_ranks(ranks),
        "num_ranks": len(ranks),
        "excess": excess,
        "se": se if math.isfinite(se) else None,
        "num_buckets": num_buckets,
    }
