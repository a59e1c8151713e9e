"""Fleet health on generated fleets: chronic slow nodes found, one job never condemns a node."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from stepscope.analysis.fleet.health import FleetConfig, add_jobs, fleet_health
from stepscope.analysis.fleet.node_levels import job_levels
from stepscope.synthetic.fleet import FleetSpec, fleet_jobs, fleet_levels, slow_node_names
from stepscope.synthetic.generate import node_name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_three_chronically_slow_nodes_are_the_top_suspects_within_a_point(seed: int) -> None:
    spec = FleetSpec(num_nodes=64, num_jobs=200, seed=seed)
    truth = slow_node_names(spec)
    assert sorted(truth.values()) == pytest.approx([0.03, 0.06, 0.10])
    fitted = fleet_health(fleet_levels(spec))
    nodes = fitted.nodes
    assert nodes.height == 64
    top = nodes.sort("effect", descending=True).head(3)
    assert set(top["node"]) == set(truth)
    for row in top.to_dicts():
        assert abs(row["effect"] - truth[row["node"]]) <= 0.01, row
        assert row["suspect"]
        assert row["confidence"] >= 0.95
        assert row["num_jobs"] >= 10  # nodes are shared: each slow node is in many jobs
    healthy = nodes.filter(~pl.col("node").is_in(list(truth)))
    assert not healthy["suspect"].any()
    assert healthy["confidence"].max() < FleetConfig().min_confidence  # type: ignore[operator]
    assert healthy["effect"].max() < FleetConfig().min_effect  # type: ignore[operator]


def _first_job_with(spec: FleetSpec, node: int) -> int:
    for j, job in enumerate(fleet_jobs(spec)):
        if node_name(node) in job.nodes:
            return j
    raise AssertionError(f"no job placed node {node}")


def test_a_node_slow_in_one_job_only_is_not_flagged() -> None:
    base = FleetSpec(seed=3, one_off_prob=0.0)
    job = _first_job_with(base, 3)
    spec = FleetSpec(seed=3, one_off_prob=0.0, one_job_slow=((3, job, 1.5),))
    fitted = fleet_health(fleet_levels(spec))
    name = node_name(3)
    in_job = fitted.jobs.filter(pl.col("node") == name, pl.col("job_id") == f"fleet-{job:05d}")
    assert in_job["residual"][0] == pytest.approx(0.5, abs=0.05)  # that job saw it 50 % slow
    assert in_job["score"][0] == FleetConfig().clip  # and counts as no more than `clip` sigmas
    row = fitted.nodes.filter(pl.col("node") == name).row(0, named=True)
    assert not row["suspect"]
    assert row["confidence"] < 0.95
    assert abs(row["effect"]) < 0.01
    assert set(fitted.nodes.filter("suspect")["node"]) == set(slow_node_names(spec))


def test_a_node_seen_slow_in_two_jobs_only_is_not_a_suspect() -> None:
    # Two jobs of four nodes each, node b 40 % slow in both: evidence of at most 2 × clip.
    rng = np.random.default_rng(0)
    parts = []
    for j, hosts in enumerate((["a", "b", "c", "d"], ["b", "e", "f", "g"])):
        own = 0.5 * np.exp(0.01 * rng.standard_normal((30, 8)))
        own[:, hosts.index("b") * 2 : hosts.index("b") * 2 + 2] *= 1.4
        nodes = {r: hosts[r // 2] for r in range(8)}
        levels = job_levels(own, np.arange(8), nodes)
        parts.append(levels.with_columns(job_id=pl.lit(f"j{j}"), ts=pl.lit(float(j))))
    fitted = fleet_health(pl.concat(parts))
    b = fitted.nodes.filter(pl.col("node") == "b").row(0, named=True)
    assert b["raw_effect"] == pytest.approx(0.4, abs=0.03)
    assert b["z"] <= 2 * FleetConfig().clip / math.sqrt(2 * 0.25) + 1e-9
    assert not b["suspect"]


def test_a_node_that_turned_slow_is_a_suspect_since_then_and_a_repaired_one_is_not() -> None:
    spec = FleetSpec(
        seed=4,
        slow_nodes={10: 1.08, 20: 1.08},
        slow_from_job={10: 120},
        slow_until_job={20: 80},
    )
    fitted = fleet_health(fleet_levels(spec))
    turned = fitted.nodes.filter(pl.col("node") == node_name(10)).row(0, named=True)
    assert turned["suspect"]
    assert turned["effect"] == pytest.approx(0.08, abs=0.01)
    first_slow_ts = spec.start_ts + 120 * spec.job_interval_s
    # Since: its first job at or after the change (jobs come every job_interval_s, and a node
    # is in a few of them: within 15 jobs).
    assert first_slow_ts <= turned["since"] <= first_slow_ts + 15 * spec.job_interval_s
    repaired = fitted.nodes.filter(pl.col("node") == node_name(20)).row(0, named=True)
    assert not repaired["suspect"]
    assert repaired["since"] is not None  # the change to healthy was found
    assert repaired["since"] >= spec.start_ts + 80 * spec.job_interval_s
    assert abs(repaired["effect"]) < 0.01


def test_job_levels_give_each_node_and_gpu_its_excess_over_the_median_rank() -> None:
    rng = np.random.default_rng(1)
    own = 0.4 * np.exp(0.005 * rng.standard_normal((50, 12)))
    own[:, 4:8] *= 1.05  # node b (ranks 4-7) 5 % slow
    own[:, 9] *= 1.20  # one GPU of node c 20 % slow
    nodes = {r: "abc"[r // 4] for r in range(12)}
    gpus = {r: f"GPU-{r}" for r in range(12)}
    levels = job_levels(own, np.arange(12), nodes, gpus)
    node_rows = levels.filter(pl.col("gpu") == "").sort("node")
    assert node_rows["node"].to_list() == ["a", "b", "c"]
    assert node_rows["ranks"].to_list() == ["0-3", "4-7", "8-11"]
    b = node_rows.row(1, named=True)
    assert math.expm1(b["excess"]) == pytest.approx(0.05, abs=0.005)
    assert 0 < b["se"] < 0.002
    gpu9 = levels.filter(pl.col("gpu") == "GPU-9").row(0, named=True)
    assert gpu9["node"] == "c"
    assert gpu9["ranks"] == "9"
    assert math.expm1(gpu9["excess"]) == pytest.approx(0.20, abs=0.01)
    assert levels.filter(pl.col("gpu") != "").height == 12
    alone = job_levels(own[:, :4], np.arange(4), dict.fromkeys(range(4), "a"))
    assert alone.is_empty()  # one node: no level against itself


def test_the_fit_does_not_depend_on_the_order_of_the_rows_or_a_warm_start() -> None:
    spec = FleetSpec(
        seed=5, num_jobs=120, slow_nodes={4: 1.07}, slow_from_job={4: 40}, one_off_prob=0.05
    )
    levels = fleet_levels(spec)
    in_time = fleet_health(levels.sort("ts", "job_id"))
    shuffled = fleet_health(levels.sample(fraction=1.0, shuffle=True, seed=1))
    columns = ["node", "suspect", "num_jobs", "since"]
    assert shuffled.nodes.select(columns).equals(in_time.nodes.select(columns))
    assert np.allclose(shuffled.nodes["effect"], in_time.nodes["effect"], atol=1e-9)
    # A refit after one job more, from the previous fit, lands where a cold fit does.
    more = FleetSpec(
        seed=5, num_jobs=121, slow_nodes={4: 1.07}, slow_from_job={4: 40}, one_off_prob=0.05
    )
    cold = fleet_health(fleet_levels(more))
    warm = fleet_health(fleet_levels(more), start=in_time.fit)
    cold_nodes, warm_nodes = cold.nodes.sort("node"), warm.nodes.sort("node")
    assert warm_nodes.select(columns).equals(cold_nodes.select(columns))
    assert np.allclose(warm_nodes["effect"], cold_nodes["effect"], atol=1e-3)
    assert cold.nodes.filter(pl.col("node") == node_name(4))["suspect"][0]


def test_new_jobs_added_to_a_fit_land_where_a_full_fit_does() -> None:
    # Node 9 turns slow late: its change shows only with the jobs added.
    spec = FleetSpec(seed=3, num_jobs=220, slow_nodes={4: 1.07, 9: 1.05}, slow_from_job={9: 185})
    levels = fleet_levels(spec)
    jobs_in_time = levels.group_by("job_id").agg(pl.col("ts").min()).sort("ts", "job_id")
    last_jobs = jobs_in_time["job_id"].tail(20).implode()
    before = levels.filter(~pl.col("job_id").is_in(last_jobs))
    # A node no job had before, in a job of its own with a known node (it joins the fleet).
    newcomer = levels.filter(pl.col("job_id").is_in(last_jobs), pl.col("gpu") == "")
    newcomer = newcomer.head(2).with_columns(
        job_id=pl.lit("with-a-new-node"), node=pl.Series(["brand-new", newcomer["node"][1]])
    )
    added = pl.concat([levels.filter(pl.col("job_id").is_in(last_jobs)), newcomer])

    fitted = fleet_health(before)
    assert fitted.state is not None
    assert fitted.jobs["current"].all()
    updated = add_jobs(fitted, added)
    full = fleet_health(pl.concat([before, added]), start=fitted.fit)
    assert updated is not None
    assert updated.state is not None
    assert updated.state.num_added_jobs == 21
    local_jobs, refitted_jobs = (f.jobs.sort("job_id", "node") for f in (updated, full))
    assert local_jobs["current"].equals(refitted_jobs["current"])
    assert not local_jobs["current"].all()
    # Offsets of the jobs fitted before stay (a full fit moves those of small jobs a little).
    moved = (local_jobs["residual"] - refitted_jobs["residual"]).abs()
    assert moved.quantile(0.99) < 1e-3
    assert moved.max() < 0.5 * updated.tau  # type: ignore[operator]
    columns = ["node", "suspect", "num_jobs", "num_jobs_total", "since"]
    local, refitted = updated.nodes.sort("node"), full.nodes.sort("node")
    assert local.select(columns).equals(refitted.select(columns))
    assert np.allclose(local["effect"], refitted["effect"], atol=2e-3)
    assert np.allclose(local["confidence"], refitted["confidence"], atol=0.05)
    assert set(updated.nodes.filter(pl.col("suspect"))["node"]) == {node_name(4), node_name(9)}
    assert updated.fit is not None
    assert full.fit is not None
    effects = updated.fit.join(full.fit, on=["kind", "name"], how="full", coalesce=True)
    assert effects.height == full.fit.height
    # One job of two nodes places the new node loosely; every other node lands close.
    effects = effects.filter(pl.col("kind") == "node", pl.col("name") != "brand-new")
    assert np.allclose(effects["value"], effects["value_right"], atol=1e-3)
    # Jobs fitted already need a full fit.
    assert add_jobs(updated, newcomer) is None
