"""GET /api/v1/jobs/{id}/goodput on a real server, SQLite and PostgreSQL: a job with a restart
sent through the wire protocol, against its known truth."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stepscope.schema import GOODPUT_CATEGORIES
from stepscope.synthetic.goodput_timelines import Failure, Scenario, generate
from tests.goodput_jobs import batches
from tests.live_server import RunningServer, run_server

JOB = "goodput-restart"


@pytest.fixture
def server(db_url: str) -> Iterator[RunningServer]:
    with run_server(db_url) as running:
        yield running


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
        _assert_windows(client, doc)


def _assert_windows(client: httpx.Client, doc: dict[str, Any]) -> None:
    """Goodput over time: the default windows cover the job and add up to its totals; 5 s
    windows inside the restart's downtime hold restart downtime alone."""
    span_s = doc["ended_at"] - doc["started_at"]
    default = doc["windows"]
    assert doc["window_s"] > 0
    assert len(default) == math.ceil(span_s / doc["window_s"] - 1e-9)
    assert len(default) <= 100
    assert default[0]["start"] == pytest.approx(doc["started_at"])
    assert sum(w["gpu_s"] for w in default) == pytest.approx(doc["total_gpu_s"], rel=1e-9)
    for category in GOODPUT_CATEGORIES:
        in_windows = sum(w["categories"][category] for w in default)
        assert in_windows == pytest.approx(doc["categories"][category]["gpu_s"], abs=1e-6)
    five = client.get(f"/api/v1/jobs/{JOB}/goodput", params={"window_s": 5}).json()
    assert five["window_s"] == 5.0
    down_from = doc["incarnations"][0]["ended_at"]
    down_to = doc["incarnations"][1]["started_at"]
    assert down_to - down_from == pytest.approx(40.0, abs=5.0)
    inside = [w for w in five["windows"] if w["start"] >= down_from and w["end"] <= down_to]
    assert len(inside) >= 6
    for w in inside:
        assert w["categories"]["restart_downtime"] == pytest.approx(w["gpu_s"], rel=1e-9)
        assert w["gpu_s"] == pytest.approx(4 * 5.0)
    for bad in ("0", "-3", "soon"):
        response = client.get(f"/api/v1/jobs/{JOB}/goodput", params={"window_s": bad})
        assert response.status_code == 422
        assert "window_s" in response.text
    response = client.get(f"/api/v1/jobs/{JOB}/goodput", params={"window_s": 0.001})
    assert response.status_code == 422
    assert "window_s" in response.json()["detail"]


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
