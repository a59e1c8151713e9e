"""GET /api/v1/nodes and /nodes/{node} on a real server, SQLite and PostgreSQL: a generated
fleet of 200 jobs over 64 nodes stored as analysed jobs (their node levels), three nodes
chronically slow; then a job more, and a job deleted."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import polars as pl
import pytest

from stepscope.store.deletion import delete_job
from stepscope.store.engine import make_engine
from stepscope.synthetic.fleet import FleetSpec, fleet_jobs, fleet_levels, write_fleet
from stepscope.synthetic.fleet import slow_node_names as truth_of
from tests.live_server import RunningServer, run_server

SPEC = FleetSpec(num_nodes=64, num_jobs=200, seed=0)


@pytest.fixture
def fleet(db_url: str) -> Iterator[tuple[RunningServer, pl.DataFrame]]:
    levels = fleet_levels(SPEC, with_gpus=True)
    engine = make_engine(db_url)
    write_fleet(engine, levels)
    engine.dispose()
    with run_server(db_url) as server:
        yield server, levels


def get(server: RunningServer, path: str, **params: object) -> httpx.Response:
    return httpx.get(f"{server.url}/api/v1{path}", params=params, timeout=60)  # type: ignore[arg-type]


def test_the_slow_nodes_are_the_suspects_and_a_node_shows_its_jobs_and_gpus(
    fleet: tuple[RunningServer, pl.DataFrame],
) -> None:
    server, levels = fleet
    truth = truth_of(SPEC)

    suspects = get(server, "/nodes", suspect=True).json()
    assert suspects["num_nodes"] == 64
    assert suspects["num_jobs"] == SPEC.num_jobs
    assert suspects["num_suspects"] == 3
    listed = [n["node"] for n in suspects["nodes"]]
    assert listed == sorted(truth, key=truth.__getitem__, reverse=True)  # by effect
    for n in suspects["nodes"]:
        assert n["effect"] == pytest.approx(truth[n["node"]], abs=0.01)
        assert n["confidence"] >= 0.95
        assert n["since"] == n["first_ts"]  # slow from its first job on

    everyone = get(server, "/nodes", sort="-confidence", limit=1000).json()["nodes"]
    assert len(everyone) == 64
    confidences = [n["confidence"] for n in everyone]
    assert confidences == sorted(confidences, reverse=True)
    assert sum(n["suspect"] for n in everyone) == 3
    named = get(server, "/nodes", name="node-005").json()["nodes"]
    assert sorted(n["node"] for n in named) == [f"node-005{i}" for i in range(10)]

    slowest = listed[0]
    detail = get(server, f"/nodes/{slowest}").json()
    own = levels.filter(pl.col("node") == slowest, pl.col("gpu") == "")
    assert [j["job_id"] for j in detail["jobs"]] == own.sort("ts")["job_id"].to_list()
    assert detail["node"]["num_jobs_total"] == own.height
    assert all(j["residual"] > 0.05 for j in detail["jobs"])
    assert all(j["name"] == f"fleet job {j['job_id']}" for j in detail["jobs"])
    gpus = detail["gpus"]
    assert len(gpus) == SPEC.ranks_per_node
    assert {g["gpu"] for g in gpus} == {f"GPU-00{slowest[-2:]}-{i}" for i in range(8)}
    assert all(g["num_jobs"] == own.height for g in gpus)
    excess = sorted(g["median_excess"] for g in gpus)
    assert excess[0] > 0.05  # every GPU of the slow node is slow
    assert excess[len(excess) // 2] == pytest.approx(truth[slowest], abs=0.01)


def test_unknown_nodes_and_bad_parameters_are_refused(
    fleet: tuple[RunningServer, pl.DataFrame],
) -> None:
    server, _ = fleet
    missing = get(server, "/nodes/no-such-host")
    assert missing.status_code == 404
    assert "no-such-host" in missing.json()["detail"]
    bad = get(server, "/nodes", sort="-speed")
    assert bad.status_code == 422
    assert "sort" in bad.json()["detail"]
    assert get(server, "/nodes", min_confidence=2).status_code == 422


def test_a_new_job_and_a_deleted_one_change_the_answer(
    fleet: tuple[RunningServer, pl.DataFrame],
) -> None:
    server, levels = fleet
    slowest = max(truth_of(SPEC).items(), key=lambda kv: kv[1])[0]
    before = get(server, f"/nodes/{slowest}").json()["node"]["num_jobs_total"]

    # One more job on the slowest node and a healthy one, stored as its pass would.
    extra = FleetSpec(num_nodes=64, num_jobs=1, nodes_per_job=(2,), seed=99)
    job = next(fleet_jobs(extra))
    hosts = sorted(set(job.nodes))
    renamed = {hosts[0]: slowest, hosts[1]: "node-0000"}
    more = fleet_levels(extra).with_columns(
        pl.col("node").replace(renamed), job_id=pl.lit("fleet-extra")
    )
    engine = make_engine(server.db_url)
    write_fleet(engine, more)
    assert get(server, f"/nodes/{slowest}").json()["node"]["num_jobs_total"] == before + 1

    first = levels.filter(pl.col("node") == slowest)["job_id"][0]
    delete_job(engine, first)
    engine.dispose()
    detail = get(server, f"/nodes/{slowest}").json()
    assert detail["node"]["num_jobs_total"] == before
    assert first not in [j["job_id"] for j in detail["jobs"]]
    assert "fleet-extra" in [j["job_id"] for j in detail["jobs"]]
