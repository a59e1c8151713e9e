"""Who waited for whom, per process group: peer lateness, without synchronised clocks.

The members of a group run the same collective calls; the step's calls of an op are the
same calls on every member when their `first_seq` (the group's sequence number of the first
of them) is equal. A call completes when its last member arrives, so the member that
arrived last spends the least time in it: per (step, group, op), a member's lateness is its
busy time minus the smallest busy time over the members (its peers waited that long for
the last one). A straggler's peers wait for it in the groups it belongs to; the group where
they waited most names the parallelism dimension it slows (tp, dp_shard, pp, ...).
"""

from __future__ import annotations

from typing import Any

import polars as pl

from stepscope.analysis.communication.collectives import group_labels, with_groups
from stepscope.schema import compact_ranks

_KEY = ("step", "group", "op")


def peer_lateness(collectives: pl.DataFrame) -> pl.DataFrame:
    """Per (rank, step, group, op): `lateness_s`, busy_s minus the smallest busy_s over the
    group's members in that step, with the group's label (column `label`), mesh_dim and
    group_ranks. Only (step, group, op) with two members or more that all reported the same
    first_seq are kept (rows without first_seq say nothing about which calls they timed)."""
    rows = with_groups(collectives)
    rows = rows.with_columns(group_labels(rows).alias("label"))
    key = list(_KEY)
    return (
        rows.lazy()
        .filter(pl.col("first_seq").is_not_null().all().over(key))
        .filter(
            (pl.col("first_seq").n_unique().over(key) == 1)
            & (pl.col("rank").n_unique().over(key) >= 2)
        )
        .select(
            "rank",
            *key,
            "label",
            "mesh_dim",
            "group_ranks",
            (pl.col("busy_s") - pl.col("busy_s").min().over(key)).alias("lateness_s"),
        )
        .collect()
    )


class GroupEvidence:
    """For a straggler (rank, first_step, last_step): the group its peers waited for it in
    most, from the collectives rows of those steps."""

    def __init__(self, collectives: pl.DataFrame | None) -> None:
        self._rows = collectives
        if collectives is not None and (
            "first_seq" not in collectives.columns
            or collectives["first_seq"].null_count() == collectives.height
        ):
            self._rows = None  # older profilers: calls cannot be matched across members

    def __call__(self, rank: int, first_step: int, last_step: int) -> dict[str, Any]:
        """{"group": label, "group_name", "group_ranks", "mesh_dim", "peers_lateness_s",
        "rank_lateness_s"} (medians over the steps of the rank's and of its peers' median
        lateness, summed over the group's ops), or {} when its peers never waited for it."""
        if self._rows is None:
            return {}
        rows = self._rows.filter(pl.col("step").is_between(first_step, last_step))
        if "group" in rows.columns:
            mine = rows.filter(pl.col("rank") == rank).select(pl.col("group").unique())
            rows = rows.join(mine, on="group", how="semi")
        late = peer_lateness(rows)
        if late.is_empty():
            return {}
        per_rank = late.group_by("step", "group", "rank").agg(
            pl.col("lateness_s").sum(),
            pl.col("label", "mesh_dim", "group_ranks").first(),
        )
        is_rank = pl.col("rank") == rank
        peers = (
            per_rank.filter(~is_rank)
            .group_by("step", "group")
            .agg(
                pl.col("lateness_s").median().alias("peers"),
                pl.col("rank").unique().alias("members"),
            )
        )
        steps = per_rank.filter(is_rank).join(peers, on=["step", "group"])
        if steps.is_empty():
            return {}
        summary = (
            steps.group_by("group")
            .agg(
                pl.col("label", "mesh_dim", "group_ranks").first(),
                pl.col("peers").median().alias("peers_lateness_s"),
                pl.col("lateness_s").median().alias("rank_lateness_s"),
                (pl.col("peers") - pl.col("lateness_s")).median().alias("waited_s"),
                pl.col("members").explode().unique().alias("members"),
            )
            .sort("waited_s", "group", descending=[True, False])
        )
        best = summary.row(0, named=True)
        if not best["waited_s"] > 0:
            return {}
        members = best["group_ranks"] or compact_ranks(sorted({rank, *best["members"]}))
        return {
            "group": best["label"],
            "group_name": best["group"],
            "group_ranks": members,
            "mesh_dim": best["mesh_dim"],
            "peers_lateness_s": float(best["peers_lateness_s"]),
            "rank_lateness_s": float(best["rank_lateness_s"]),
        }


def pipeline_stage(mesh: Any) -> int | None:
    """A rank's pipeline stage: the coordinate of its mesh's "pp" dimension, if it has one."""
    if not isinstance(mesh, dict):
        return None
    pp = mesh.get("pp")
    if isinstance(pp, list | tuple) and pp and isinstance(pp[0], int):
        return int(pp[0])
    return None
