"""What a change between jobs is made of: time components and ranks.

Components are the critical-path parts of the job's step (stepscope.analysis.frames.steady
.job_metrics): each one's change in seconds and its share of the summed change. Ranks say
whether the change is spread over the job or sits on some ranks or a node (a new straggler):
each rank's own work (data_s + compute_s: what it does before it joins the collective) in
the candidate against the same rank in the baselines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import polars as pl

from stepscope.analysis.frames.steady import COMPONENTS
from stepscope.analysis.stats.robust import mad_sigma

RankScope = Literal["spread", "ranks", "node"]
_MIN_RANKS_FOR_SPREAD = 5
"""Fewer ranks than this say nothing about the spread between ranks."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentChange:
    """One component's level in the baselines and the candidate, and its share of the change."""

    metric: str
    baseline_s: float
    candidate_s: float
    change_s: float
    share: float
    """change_s / the summed change of all components (NaN when that sum is 0)."""
    step_share: float
    """change_s / the baselines' step time."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankChange:
    """A rank whose own work grew more than the job's typical rank's."""

    rank: int
    node: str | None
    baseline_s: float
    """Its own work (data_s + compute_s) per step in the baselines."""
    candidate_s: float
    growth: float
    """candidate_s / baseline_s − 1."""
    component: str
    """data_s or compute_s, whichever grew more on this rank."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankAttribution:
    """Spread over the job's ranks, or concentrated on some ranks or nodes."""

    scope: RankScope
    typical_growth: float
    """Median over ranks of the growth of their own work."""
    ranks: list[RankChange]
    """Ranks that grew beyond the typical rank, most first."""
    nodes: list[str]
    """Nodes most of whose ranks are among them (scope "node")."""
    num_ranks: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Attribution:
    components: list[ComponentChange]
    """Largest change first."""
    cause: str | None
    """The component that grew most, when the components grew."""
    ranks: RankAttribution | None
    """None without per-rank data."""


def component_changes(
    candidate_log: dict[str, float], baseline_log: dict[str, float], baseline_step_s: float
) -> list[ComponentChange]:
    """Changes of the components present in both (log levels: mean over runs), largest first."""
    present = [m for m in COMPONENTS if m in candidate_log and m in baseline_log]
    before = {m: math.exp(baseline_log[m]) for m in present}
    after = {m: math.exp(candidate_log[m]) for m in present}
    total = sum(after[m] - before[m] for m in present)
    changes = [
        ComponentChange(
            metric=m,
            baseline_s=before[m],
            candidate_s=after[m],
            change_s=after[m] - before[m],
            share=(after[m] - before[m]) / total if total != 0 else math.nan,
            step_share=(after[m] - before[m]) / baseline_step_s,
        )
        for m in present
    ]
    return sorted(changes, key=lambda c: -c.change_s)


def rank_attribution(
    candidates: Sequence[pl.DataFrame],
    baselines: Sequence[pl.DataFrame],
    *,
    min_growth: float,
    node_share: float = 0.5,
) -> RankAttribution | None:
    """Which ranks' own work grew: frames of rank, node, data_s, compute_s (s per step) per
    job; a rank counts when its growth exceeds the typical rank's by `min_growth` and by 5
    times the noise (a rank's run-to-run spread in the baselines and, with 5 ranks or more,
    the spread between ranks). None without candidate or baseline ranks."""
    if not candidates or not baselines:
        return None
    cand = _per_rank(candidates)
    base = _per_rank(baselines)
    typical_base = {c: float(np.median(base[c].to_numpy())) for c in ("data_s", "compute_s")}
    joined = cand.join(base, on="rank", how="left", suffix="_base").with_columns(
        pl.col(f"{c}_base").fill_null(typical_base[c]) for c in ("data_s", "compute_s")
    )
    joined = joined.with_columns(
        (pl.col("data_s") + pl.col("compute_s")).alias("own_s"),
        (pl.col("data_s_base") + pl.col("compute_s_base")).alias("own_base_s"),
    ).filter(pl.col("own_base_s") > 0)
    if joined.is_empty():
        return None
    growth = (joined["own_s"] / joined["own_base_s"] - 1.0).to_numpy()
    # The lower median: with 2 ranks, the other rank is the typical one.
    typical = float(np.percentile(growth, 50, method="lower"))
    excess = growth - typical
    noise = [5.0 * _run_to_run(baselines)]
    if growth.size >= _MIN_RANKS_FOR_SPREAD:  # the spread between ranks says what is noise
        noise.append(5.0 * mad_sigma(excess))
    flagged = np.flatnonzero(excess >= max(min_growth, *noise))
    flagged = flagged[np.argsort(-growth[flagged])]
    changes = [
        RankChange(
            rank=int(row["rank"]),
            node=row["node"],
            baseline_s=float(row["own_base_s"]),
            candidate_s=float(row["own_s"]),
            growth=float(growth[i]),
            component="data_s"
            if row["data_s"] - row["data_s_base"] > row["compute_s"] - row["compute_s_base"]
            else "compute_s",
        )
        for i in flagged
        for row in [joined.row(int(i), named=True)]
    ]
    num_ranks = joined.height
    if not changes or len(changes) > num_ranks / 2:
        return RankAttribution(
            scope="spread", typical_growth=typical, ranks=[], nodes=[], num_ranks=num_ranks
        )
    nodes = _slow_nodes(joined["node"].to_list(), {c.rank for c in changes}, joined, node_share)
    on_nodes = bool(nodes) and all(c.node in nodes for c in changes)
    return RankAttribution(
        scope="node" if on_nodes else "ranks",
        typical_growth=typical,
        ranks=changes,
        nodes=nodes,
        num_ranks=num_ranks,
    )


def _run_to_run(frames: Sequence[pl.DataFrame]) -> float:
    """Typical (median over ranks) relative spread of a rank's own work between jobs; 0 with
    fewer than 2 jobs."""
    if len(frames) < 2:
        return 0.0
    own = pl.concat(
        [
            f.select(
                pl.col("rank").cast(pl.Int64),
                (pl.col("data_s") + pl.col("compute_s")).cast(pl.Float64).alias("own_s"),
            )
            for f in frames
        ]
    ).drop_nulls()
    spread = own.group_by("rank").agg(
        (pl.col("own_s").std() / pl.col("own_s").mean()).alias("relative")
    )
    values = spread["relative"].drop_nulls().to_numpy()
    return float(np.median(values)) if values.size else 0.0


def _per_rank(frames: Sequence[pl.DataFrame]) -> pl.DataFrame:
    """rank, node, data_s, compute_s: medians over the jobs of each rank's values."""
    stacked = pl.concat(
        [
            f.select(
                pl.col("rank").cast(pl.Int64),
                (pl.col("node") if "node" in f.columns else pl.lit(None))
                .cast(pl.String)
                .alias("node"),
                pl.col("data_s").cast(pl.Float64),
                pl.col("compute_s").cast(pl.Float64),
            )
            for f in frames
        ]
    )
    return (
        stacked.drop_nulls(["data_s", "compute_s"])
        .group_by("rank")
        .agg(pl.col("node").drop_nulls().first(), pl.col("data_s", "compute_s").median())
        .sort("rank")
    )


def _slow_nodes(
    nodes: list[str | None], slow_ranks: set[int], joined: pl.DataFrame, share: float
) -> list[str]:
    """Nodes more than `share` of whose ranks are slow."""
    ranks = joined["rank"].to_list()
    found = []
    for node in sorted({n for n in nodes if n is not None}):
        on_node = [r for r, n in zip(ranks, nodes, strict=True) if n == node]
        if on_node and sum(r in slow_ranks for r in on_node) / len(on_node) > share:
            found.append(node)
    return found
