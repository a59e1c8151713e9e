"""What the demo loads beside its real job: the fleet once per database, and a large job that
leaves the fleet's story as it was."""

from __future__ import annotations

from stepscope.demo import extras
from stepscope.query.fleet import NodeFilters, list_nodes
from stepscope.store.engine import make_engine
from stepscope.synthetic.fleet import slow_node_names
from tests.live_server import read_rows


def test_the_fleet_is_loaded_once_per_database(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        assert extras.load_fleet(engine) == extras.FLEET.num_jobs
        assert extras.load_fleet(engine) == 0  # a second demo on the same database
    finally:
        engine.dispose()
    job_ids = sorted(j["job_id"] for j in read_rows(db_url, "jobs", None))
    assert job_ids == [f"demo-fleet-{j:05d}" for j in range(extras.FLEET.num_jobs)]
    nodes = {r["node"] for r in read_rows(db_url, "node_levels", None)}
    assert set(slow_node_names(extras.FLEET)) <= nodes


def test_beside_the_large_job_fleet_health_suspects_the_fleets_slow_nodes_only(
    db_url: str,
) -> None:
    engine = make_engine(db_url)
    try:
        extras.load_large_job(engine, "demo-x-synthetic-1024")
        extras.load_fleet(engine)
        page = list_nodes(engine, NodeFilters(suspect=True))
    finally:
        engine.dispose()
    # The large job ran on nodes of its own: none of its healthy ones hides a slow fleet node.
    assert page.num_nodes == extras.FLEET.num_nodes + len(extras.LARGE_HOSTS)
    assert page.num_jobs == extras.FLEET.num_jobs + 1
    assert page.num_suspects == len(extras.FLEET.slow_nodes)
    assert {n["node"] for n in page.nodes} == set(slow_node_names(extras.FLEET))
