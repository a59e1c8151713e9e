"""Collectives per process group: rollups per group label, summed op grids, peer lateness
and the group a straggler's peers waited for it in (a hand-built 2 × 2 mesh job)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from stepscope.analysis import analyze
from stepscope.analysis.communication.collectives import op_grids, slow_collective_findings
from stepscope.analysis.communication.groups import peer_lateness
from stepscope.analysis.config import AnalysisConfig
from stepscope.analysis.frames.grid import Grid
from stepscope.analysis.rollups import op_rollup
from stepscope.schema import Finding
from tests.mesh_jobs import (
    AG_S,
    AR_S,
    JOB_ID,
    LATE_FROM,
    LATE_RANK,
    LATE_S,
    NUM_STEPS,
    TP_SHARE,
    mesh_job,
    mesh_of,
    old_format,
)

STRAGGLER_KINDS = ("straggler_rank", "straggler_node", "gpu_throttling")


def _stragglers(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.kind in STRAGGLER_KINDS]


def test_a_late_rank_is_named_with_the_group_whose_peers_waited_for_it() -> None:
    frames = mesh_job()
    found = analyze(frames["steps"], collectives=frames["collectives"], ranks=frames["ranks"])
    (f,) = _stragglers(found)
    assert (f.kind, f.ranks, f.cause, f.last_step) == (
        "straggler_rank",
        [LATE_RANK],
        "compute",
        None,
    )
    assert f.first_step == pytest.approx(LATE_FROM, abs=2)
    assert f.effect == pytest.approx(LATE_S / (0.51 + AG_S + AR_S), rel=0.1)
    group = f.evidence["group"]
    # Rank 1 waits for it in their dp_shard all-gather (all of the 50 ms), rank 2 only 60% of
    # it in their tp all-reduce: the peers waited longest in dp_shard.
    assert {k: group[k] for k in ("group", "group_name", "group_ranks", "mesh_dim")} == {
        "group": "dp_shard",
        "group_name": "4",
        "group_ranks": "1-3:2",
        "mesh_dim": "dp_shard",
    }
    assert group["peers_lateness_s"] == pytest.approx(LATE_S, abs=0.003)
    assert group["rank_lateness_s"] == 0.0
    assert "stage" not in f.evidence  # no pipeline dimension


def test_a_pipeline_rank_carries_its_stage() -> None:
    frames = mesh_job()
    ranks = frames["ranks"].with_columns(
        pl.Series("mesh", [json.dumps(mesh_of(r, ("pp", "tp"))) for r in range(4)])
    )
    (f,) = _stragglers(analyze(frames["steps"], collectives=frames["collectives"], ranks=ranks))
    assert f.evidence["stage"] == 1  # rank 3 = pp coordinate 1


def test_peer_lateness_is_busy_time_over_the_fastest_member_of_the_same_calls() -> None:
    frames = mesh_job()
    last = pl.col("step") == NUM_STEPS - 1
    late = peer_lateness(frames["collectives"].filter(last))
    by = {(r, op): x for r, op, x in late.select("rank", "op", "lateness_s").iter_rows()}
    assert by[(LATE_RANK, "all_gather")] == 0.0
    assert by[(LATE_RANK, "all_reduce")] == 0.0
    # A peer's lateness is its extra wait for rank 3 (the difference of their waits), all of
    # it in rank 1's all-gather, TP_SHARE of it in rank 2's all-reduce.
    wait = frames["steps"].filter(last).sort("rank")["comm_wait_s"].to_numpy()
    assert by[(1, "all_gather")] == pytest.approx(wait[1] - wait[3], rel=1e-9)
    assert by[(2, "all_reduce")] == pytest.approx(TP_SHARE * (wait[2] - wait[3]), rel=1e-9)
    assert wait[1] - wait[3] == pytest.approx(LATE_S, abs=0.02)
    assert set(late["label"]) == {"dp_shard", "tp"}


def test_members_that_disagree_on_the_calls_or_do_not_number_them_are_skipped() -> None:
    rows = mesh_job()["collectives"].filter(pl.col("step") == 200)
    # Rank 1 numbers its all-gathers one call further: the group's rows are not comparable.
    shifted = rows.with_columns(
        pl.when((pl.col("rank") == 1) & (pl.col("op") == "all_gather"))
        .then(pl.col("first_seq") + 1)
        .otherwise(pl.col("first_seq"))
        .alias("first_seq")
    )
    late = peer_lateness(shifted)
    assert sorted(late.filter(pl.col("op") == "all_gather")["rank"].to_list()) == [0, 2]
    assert late.filter(pl.col("op") == "all_reduce").height == 4
    unnumbered = peer_lateness(rows.with_columns(pl.lit(None, dtype=pl.Int64).alias("first_seq")))
    assert unnumbered.is_empty()


def test_op_rollup_is_per_step_group_label_and_op() -> None:
    frames = mesh_job()
    rollup = op_rollup(frames["collectives"])
    assert rollup.columns[:3] == ["step", "group", "op"]
    assert rollup.height == 2 * NUM_STEPS
    first = rollup.filter(pl.col("step") == 0).select("group", "op", "num_ranks", "group_size")
    # Both dp_shard groups roll up as "dp_shard", both tp groups as "tp".
    assert first.rows() == [("dp_shard", "all_gather", 4, 2), ("tp", "all_reduce", 4, 2)]
    old = op_rollup(old_format(frames["collectives"]))
    assert set(old["group"]) == {"all"}
    assert old.drop("group").equals(rollup.drop("group"))


def test_groups_without_a_mesh_dimension_are_labelled_by_name_and_summed_per_rank() -> None:
    rows = mesh_job()["collectives"].filter(pl.col("step") < 3)
    # Both all-reduce groups without a mesh dimension and named alike on every rank: one label.
    untyped = rows.with_columns(pl.lit(None, dtype=pl.String).alias("mesh_dim"))
    labels = set(op_rollup(untyped)["group"])
    assert labels == {"group 1", "group 2", "group 3", "group 4"}
    # All-reduces of one rank in two groups (DDP over dp, TP over tp) sum into one op grid.
    both = rows.with_columns(pl.lit("all_reduce").alias("op"))
    grid = Grid.of(np.repeat(np.arange(4), 3), np.tile(np.arange(3), 4))
    (g,) = op_grids(both, grid, 0)
    busy = rows.group_by("rank", "step").agg(pl.col("busy_s").sum()).sort("step", "rank")
    assert g.op == "all_reduce"
    np.testing.assert_allclose(g.busy_s.ravel(), busy["busy_s"].to_numpy(), rtol=1e-6)
    np.testing.assert_allclose(g.count, 9.0)
    rollup = op_rollup(both)
    assert rollup.filter(pl.col("step") == 0).select("group", "num_ranks").rows() == [
        ("dp_shard", 4),
        ("tp", 4),
    ]


def test_old_format_collectives_analyse_as_before_without_group_evidence() -> None:
    frames = mesh_job()
    new = analyze(frames["steps"], collectives=frames["collectives"], ranks=frames["ranks"])
    old = analyze(
        frames["steps"],
        collectives=old_format(frames["collectives"]),
        ranks=frames["ranks"].drop("mesh"),
    )

    def key(f: Finding) -> tuple[object, ...]:
        return (f.kind, f.ranks, f.first_step, f.last_step, f.cause, f.effect, f.severity)

    assert [key(f) for f in old] == [key(f) for f in new]
    (f,) = _stragglers(old)
    assert "group" not in f.evidence
    assert {k: v for k, v in f.evidence.items() if k != "group"} == {
        k: v for k, v in _stragglers(new)[0].evidence.items() if k != "group"
    }


def _slow_rollup(labels: dict[str, str]) -> pl.DataFrame:
    """op_rollup-like rows: per label an op whose busbw halves from step 200 (label -> op)."""
    steps = np.arange(400)
    parts = []
    for label, op in labels.items():
        parts.append(
            pl.DataFrame(
                {
                    "step": steps,
                    "group": label,
                    "op": op,
                    "group_size": 2,
                    "count": 1.0,
                    "bytes": float(2**26),
                    "busy_s_min": np.where(steps >= 200, 0.02, 0.01),
                }
            )
        )
    return pl.concat(parts)


def test_slow_collectives_are_per_group_label_and_name_it() -> None:
    config = AnalysisConfig()
    (f,) = slow_collective_findings(JOB_ID, _slow_rollup({"dp_shard": "all_gather"}), 20, config)
    assert (f.metric, f.first_step, f.evidence["group"]) == (
        "all_gather.busbw_bps",
        200,
        "dp_shard",
    )
    assert f.effect == pytest.approx(-0.5)
    # One op in two labels: the label is in the metric, so the findings' keys stay distinct.
    both = slow_collective_findings(
        JOB_ID, _slow_rollup({"dp": "all_reduce", "tp": "all_reduce"}), 20, config
    )
    assert sorted((f.metric, f.evidence["group"]) for f in both) == [
        ("dp.all_reduce.busbw_bps", "dp"),
        ("tp.all_reduce.busbw_bps", "tp"),
    ]
    (old,) = slow_collective_findings(
        JOB_ID, _slow_rollup({"all": "all_reduce"}).drop("group"), 20, config
    )
    assert (old.metric, old.evidence["group"]) == ("all_reduce.busbw_bps", "all")


def test_sends_and_receives_make_no_slow_collective() -> None:
    # A send lasts until its receiver takes it: twice as long when the next pipeline stage
    # computes late, whatever the link.
    rollup = _slow_rollup({"pp": "send", "group 0": "recv", "dp": "all_reduce"})
    found = slow_collective_findings(JOB_ID, rollup, 20, AnalysisConfig())
    assert [(f.metric, f.evidence["group"]) for f in found] == [("all_reduce.busbw_bps", "dp")]
