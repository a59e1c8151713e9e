"""GET /api/v1/jobs/{id}/goodput on a real server, SQLite and PostgreSQL: a job with a restart
sent through the wire protocol, against its known truth."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stepscope.schema import GOODPUT_CATEGORIES
from stepscope.synthetic.goodput_timelines import Failure, Scenario, Timeline, generate
from tests.live_server import RunningServer, run_server

JOB = "goodput-restart"


@pytest.fixture
def server(db_url: str) -> Iterator[RunningServer]:
    with run_server(db_url) as running:
        yield running


def batches(timeline: Timeline, job_id: str) -> list[dict[str, Any]]:
    """One wire batch per rank: its step rows and its events."""
    assert timeline.rank_rows is not None
    out = []
    for rank in range(timeline.world_size):
        rows = timeline.rank_rows.filter(timeline.rank_rows["rank"] == rank)
        events = timeline.events.filter(timeline.events["rank"] == rank)
        out.append(
            {
                "schema": 1,
                "job": {"job_id": job_id, "world_size": timeline.world_size},
                "source": {"rank": rank, "incarnation": "one-sender"},
                "seq": 0,
                "steps": {
                    c: rows[c].to_list() for c in ("step", "ts", "step_s", "data_s", "comm_wait_s")
                },
                "events": [
                    {
                        "ts": ts,
                        "kind": kind,
                        "message": message,
                        "attributes": json.loads(attributes),
                    }
                    for ts, kind, message, attributes in events.select(
                        "ts", "kind", "message", "attributes"
                    ).iter_rows()
                ],
            }
        )
    return out


def test_goodput_of_a_restarted_job_matches_its_truth(server: RunningServer) -> None:
    timeline = generate(
        Scenario(
            world_size=4,
            num_steps=120,
            ckpt_every=20,
            failures=[Failure(at_step=50, rank=3, downtime_s=40.0)],
            rank_rows=True,
            seed=11,
        )
    )
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for batch in batches(timeline, JOB):
            assert client.post("/v1/ingest", json=batch).status_code == 200
        assert client.post(f"/api/v1/jobs/{JOB}/analyze").status_code == 200
        doc = client.get(f"/api/v1/jobs/{JOB}/goodput").json()
        assert doc["total_gpu_s"] == pytest.approx(timeline.total_s, rel=1e-9)
        for category in GOODPUT_CATEGORIES:
            truth = timeline.truth[category] / timeline.total_s
            assert doc["categories"][category]["share"] == pytest.approx(truth, abs=0.005), category
        first, second = doc["incarnations"]
        assert first["lost_steps"] == [40, 49]
        assert first["failure"]["rank"] == 3
        assert second["first_step"] == 40
        assert doc["responsible"]["lost_progress"][0]["ranks"] == [3]

        per_rank = client.get(f"/api/v1/jobs/{JOB}/goodput", params={"per_rank": "true"}).json()
        assert sorted(per_rank["ranks"]) == ["0", "1", "2", "3"]
        for rank_doc in per_rank["ranks"].values():
            assert rank_doc["goodput"] == pytest.approx(doc["goodput"], abs=0.01)

        assert client.get("/api/v1/jobs/nope/goodput").status_code == 404


def test_a_lifecycle_event_missing_an_attribute_is_refused_whole(server: RunningServer) -> None:
    good = {"ts": 1.7e9, "kind": "start", "attributes": {"incarnation": "a"}}
    bad = {"ts": 1.7e9 + 1, "kind": "phase", "attributes": {"incarnation": "a", "name": "eval"}}
    batch = {
        "schema": 1,
        "job": {"job_id": "bad-phase"},
        "source": {"rank": 0, "incarnation": "a"},
        "seq": 0,
        "steps": {"step": [0], "ts": [1.7e9], "step_s": [1.0], "data_s": [0.0]},
        "events": [good, bad],
    }
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/v1/ingest", json=batch)
        assert response.status_code == 422
        assert "events[1].attributes.duration_s" in response.text
        negative = {**bad, "attributes": {**bad["attributes"], "duration_s": -1.0}}
        response = client.post("/v1/ingest", json={**batch, "events": [good, negative]})
        assert response.status_code == 422
        assert "duration_s must be a finite number >= 0" in response.text
        assert client.get("/api/v1/jobs/bad-phase").status_code == 404
