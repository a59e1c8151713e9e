"""The query layer's fleet health as jobs finish: updated by each, refitted in full now and then."""

from __future__ import annotations

import time

import polars as pl

from stepscope.analysis.fleet.health import fleet_health
from stepscope.query import fleet as fleet_query
from stepscope.store.engine import make_engine
from stepscope.synthetic.fleet import FleetSpec, fleet_levels, slow_node_names, write_fleet


def test_finished_jobs_update_the_fit_and_a_full_fit_follows_in_the_background(
    db_url: str,
) -> None:
    spec = FleetSpec(num_nodes=64, num_jobs=90, seed=4)
    levels = fleet_levels(spec)
    jobs = levels["job_id"].unique(maintain_order=True).to_list()
    engine = make_engine(db_url)
    write_fleet(engine, levels.filter(pl.col("job_id").is_in(jobs[:60])), now=1000.0)
    first = fleet_query.health(engine)
    assert first.state is not None
    assert first.state.num_added_jobs == 0

    for i, job in enumerate(jobs[60:], start=1):
        write_fleet(engine, levels.filter(pl.col("job_id") == job), now=1000.0 + i)
        fitted = fleet_query.health(engine)
        assert fitted.state is not None
        assert job in fitted.state.job_names
        if i <= 20:  # then 21 jobs (more than 1 % and 20) start a full fit in the background
            assert fitted.state.num_added_jobs == i

    # The full fit started after job 21 lands: later jobs count from it (at most 9 of them).
    deadline = time.monotonic() + 60
    while (final := fleet_query.health(engine)).state.num_added_jobs > 9:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "no full fit followed"
        time.sleep(0.05)
    engine.dispose()
    assert final.state is not None
    assert len(final.state.job_names) == 90
    full = fleet_health(levels)
    columns = ["node", "suspect", "num_jobs_total"]
    assert final.nodes.sort("node").select(columns).equals(full.nodes.sort("node").select(columns))
    assert set(final.nodes.filter(pl.col("suspect"))["node"]) == set(slow_node_names(spec))
