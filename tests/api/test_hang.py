"""GET /api/v1/jobs/{id}/hang on a real server, SQLite and PostgreSQL."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stepscope.synthetic.hangs import Layout, checkpointing, heartbeats, inject
from tests.live_server import RunningServer, run_server

TS = 1_767_000_000.0
LAYOUT = Layout(dp=4, tp=4, pp=1)


@pytest.fixture
def server(db_url: str) -> Iterator[RunningServer]:
    with run_server(db_url) as running:
        yield running


def send(client: httpx.Client, docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        assert client.post("/v1/hangs", json=doc).status_code == 200


def settled(client: httpx.Client, job_id: str) -> dict[str, Any]:
    """The job's hang once the server attributed every report it answered."""
    for _ in range(500):
        doc = client.get(f"/api/v1/jobs/{job_id}/hang").json()
        if doc.get("attributed_at") and not doc["attribution_pending"]:
            return doc
        time.sleep(0.01)
    raise AssertionError(f"not attributed: {doc}")


def test_hang_state_names_silent_ranks_and_checkpoints_are_no_hang(
    server: RunningServer,
) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/api/v1/jobs/nope/hang").status_code == 404

        send(client, heartbeats(LAYOUT, "silent", ts=TS, step=30, base_seq=100))
        hang = inject(
            LAYOUT, "silent", "silent", 2, ts=TS + 1, step=30, base_seq=100, rng=random.Random(5)
        )
        send(client, hang.reports)
        doc = settled(client, "silent")
        assert doc["hanging"] is True
        assert doc["num_reports"] == 16
        f = doc["hang"]
        assert f["ranks"] == hang.culprits
        assert f["evidence"]["class"] == "silent"
        assert doc["ranks_by_state"]["silent"] == hang.culprits
        assert sum(w["num_ranks"] for w in doc["ranks_by_state"]["waiting"].values()) == 14

        saving = checkpointing(LAYOUT, "ckpt", ts=TS, step=5, base_seq=50)
        send(client, [{**d, "kind": "heartbeat", "ts": d["ts"] - 3, "stack": None} for d in saving])
        send(client, saving)
        doc = settled(client, "ckpt")
        assert (doc["hanging"], doc["explained_by_phase"], doc["hang"]) == (True, True, None)


def test_show_prints_an_open_hang(server: RunningServer) -> None:
    hang = inject(
        LAYOUT, "shown", "never_entered", 1, ts=TS + 1, step=30, base_seq=100, rng=random.Random(1)
    )
    with httpx.Client(base_url=server.url, timeout=30) as client:
        send(client, heartbeats(LAYOUT, "shown", ts=TS, step=30, base_seq=100))
        # A job row, so that `show` finds the job.
        batch = {
            "schema": 1,
            "job": {"job_id": "shown", "world_size": 16},
            "source": {"rank": 0, "incarnation": "i"},
            "seq": 0,
        }
        assert client.post("/v1/ingest", json=batch).status_code == 200
        send(client, hang.reports)
        settled(client, "shown")
    out = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "show", "shown", "--url", server.url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (line,) = [line for line in out.splitlines() if line.startswith("HANG")]
    assert f"ranks {hang.culprits[0]} never_entered (tp all_reduce #101) in load_batch" in line
