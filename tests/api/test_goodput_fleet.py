"""GET /api/v1/goodput (the fleet view) on a real server, SQLite and PostgreSQL: three jobs
sent through the wire protocol, one window, values against hand-computed truth."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stepscope.schema import GOODPUT_CATEGORIES
from tests.live_server import RunningServer, run_server

T0 = 1.7e9


@pytest.fixture
def server(db_url: str) -> Iterator[RunningServer]:
    with run_server(db_url) as running:
        yield running


def job_batches(
    job_id: str, *, ranks: int, start: float, first_step: float, steps: int, data_s: float
) -> list[dict[str, Any]]:
    """One batch per rank: processes start at `start`, 1 s steps from `first_step`, an exit
    at the last step's end."""
    end = first_step + steps
    out = []
    for rank in range(ranks):
        inc = f"{job_id}-{rank}"
        out.append(
            {
                "schema": 1,
                "job": {"job_id": job_id, "name": f"name of {job_id}", "world_size": ranks},
                "source": {"rank": rank, "incarnation": inc},
                "seq": 0,
                "steps": {
                    "step": list(range(steps)),
                    "ts": [first_step + i for i in range(steps)],
                    "step_s": [1.0] * steps,
                    "data_s": [data_s] * steps,
                },
                "events": [
                    {"ts": start, "kind": "start", "attributes": {"incarnation": inc}},
                    {
                        "ts": first_step,
                        "kind": "resume",
                        "attributes": {"incarnation": inc, "step": 0},
                    },
                    {"ts": end, "kind": "exit", "attributes": {"incarnation": inc, "failed": 0}},
                ],
            }
        )
    return out


def test_fleet_goodput_sums_each_jobs_part_of_the_window(server: RunningServer) -> None:
    # a: 2 ranks, start 0, steps 10-20 (0.25 s data each); b: 1 rank, start 15, steps 20-40;
    # c: after the window. Window [5, 30): a 2 × 15 GPU-s (startup 10, productive 15, data 5),
    # b 15 GPU-s (startup 5, productive 10), c nothing.
    jobs = {
        "fleet-a": job_batches("fleet-a", ranks=2, start=T0, first_step=T0 + 10, steps=10,
                               data_s=0.25),
        "fleet-b": job_batches("fleet-b", ranks=1, start=T0 + 15, first_step=T0 + 20, steps=20,
                               data_s=0.0),
        "fleet-c": job_batches("fleet-c", ranks=1, start=T0 + 100, first_step=T0 + 105,
                               steps=5, data_s=0.0),
    }  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for job_id, batches in jobs.items():
            for batch in batches:
                assert client.post("/v1/ingest", json=batch).status_code == 200
            assert client.post(f"/api/v1/jobs/{job_id}/analyze").status_code == 200
        response = client.get("/api/v1/goodput", params={"since": T0 + 5, "until": T0 + 30})
        assert response.status_code == 200, response.text
        doc = response.json()
        assert (doc["since"], doc["until"], doc["num_jobs"]) == (T0 + 5, T0 + 30, 2)
        assert doc["gpu_hours"] == pytest.approx(45 / 3600)
        assert doc["goodput"] == pytest.approx(25 / 45)
        expected = {"productive": 25.0, "startup": 15.0, "data": 5.0}
        for category in GOODPUT_CATEGORIES:
            got = doc["categories"][category]
            assert got["gpu_hours"] == pytest.approx(expected.get(category, 0) / 3600, abs=1e-9)
            assert got["share"] == pytest.approx(expected.get(category, 0) / 45, abs=1e-9)
        a, b = doc["jobs"]  # most GPU-time lost first
        assert (a["job_id"], a["name"], a["world_size"]) == ("fleet-a", "name of fleet-a", 2)
        assert a["gpu_hours"] == pytest.approx(30 / 3600)
        assert a["goodput"] == pytest.approx(0.5)
        assert a["categories"]["startup"] == pytest.approx(10 / 3600)
        assert a["categories"]["data"] == pytest.approx(5 / 3600)
        assert b["job_id"] == "fleet-b"
        assert b["gpu_hours"] == pytest.approx(15 / 3600)
        assert b["categories"]["productive"] == pytest.approx(10 / 3600)

        everything = client.get("/api/v1/goodput", params={"since": 0}).json()
        assert everything["num_jobs"] == 3
        assert everything["gpu_hours"] == pytest.approx((40 + 25 + 10) / 3600)

        empty = client.get("/api/v1/goodput", params={"since": T0 - 100, "until": T0 - 50})
        assert empty.json()["num_jobs"] == 0
        assert empty.json()["goodput"] == 0.0
        backwards = client.get("/api/v1/goodput", params={"since": T0 + 30, "until": T0 + 5})
        assert backwards.status_code == 422
        assert "until" in backwards.json()["detail"]
        assert client.get("/api/v1/goodput").status_code == 422
