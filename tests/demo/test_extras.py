"""What the demo loads beside its real job: the fleet once per database."""

from __future__ import annotations

from stepscope.demo import extras
from stepscope.store.engine import make_engine
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
    assert {"node-0005", "node-0017"} <= nodes
