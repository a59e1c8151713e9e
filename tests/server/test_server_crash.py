"""`stepscope serve` SIGKILLed under a real torchrun job and restarted on the same database:
every acknowledged batch stored once, the rest resent, the job unharmed."""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.live_server import ServerProcess, read_rows
from tests.profiler.test_ddp_torchrun import torchrun

pytestmark = pytest.mark.torchrun

NUM_RANKS, NUM_STEPS = 4, 200


def _num_stored(db_url: str, job_id: str) -> int:
    try:
        return len(read_rows(db_url, "steps", job_id))
    except Exception:  # the table is not there yet
        return 0


@pytest.mark.parametrize("node_relay", [False, True], ids=["rank-posts", "stepscope-run-relay"])
def test_a_server_killed_mid_job_and_restarted_stores_every_row_once(
    tmp_path: Path, node_relay: bool
) -> None:
    """Each rank posting itself, and the ranks posting through `stepscope run`'s node relay."""
    job_id, out = "killed-server", tmp_path / "out"
    server = ServerProcess(f"sqlite:///{tmp_path / 'stepscope.db'}", log_path=tmp_path / "log")
    server.start()
    env = {"STEPSCOPE_BACKOFF_MAX_S": "1"}
    launcher: list[str] = []
    if node_relay:
        env["STEPSCOPE_URL"] = server.url
        launcher = [sys.executable, "-m", "stepscope.cli", "run", "--job-id", job_id, "--"]
    proc = torchrun(
        NUM_RANKS,
        *("--url", server.url, "--job-id", job_id, "--steps", str(NUM_STEPS)),
        *("--step-sleep-s", "0.02", "--flush-interval-s", "0.2", "--out", str(out)),
        wait=False,
        stepscope_env=env,
        launcher=launcher,
    )
    try:
        deadline = time.monotonic() + 90
        while _num_stored(server.db_url, job_id) < NUM_RANKS * 30:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no rows arrived"
            time.sleep(0.1)
        server.kill()  # mid-stream: some batches committed but not acknowledged, others queued
        killed_at = _num_stored(server.db_url, job_id)
        time.sleep(2.0)
        server.start()
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    assert proc.returncode == 0, output[-4000:]
    summaries = [json.loads((out / f"rank{r}.json").read_text()) for r in range(NUM_RANKS)]
    steps = read_rows(server.db_url, "steps", job_id)
    collectives = read_rows(server.db_url, "collectives", job_id)
    batches = read_rows(server.db_url, "ingest_batches", job_id)

    assert killed_at < NUM_RANKS * NUM_STEPS, "the kill came after the job had sent everything"
    assert "collector unreachable" in output
    # The rows the ranks made (counted by each rank), stored once each.
    for rank, summary in enumerate(summaries):
        assert summary["steps_trained"] == NUM_STEPS
        assert summary["dropped"] == {"steps": 0, "collectives": 0, "gpu": 0, "events": 0}
        mine = Counter(r["step"] for r in steps if r["rank"] == rank)
        assert mine == Counter(range(summary["steps_trained"])), rank
        assert sum(r["rank"] == rank for r in collectives) == summary["collectives_sent"]
        # Every batch the rank had acknowledged is stored once (seq 0, 1, ...); the last may be
        # the job's final status, which close() sends apart.
        seqs = sorted(b["seq"] for b in batches if b["rank"] == rank)
        assert seqs[: summary["batches_sent"]] == list(range(summary["batches_sent"]))
        assert len(seqs) - summary["batches_sent"] in (0, 1)
        stored_rows = sum(b["num_steps"] for b in batches if b["rank"] == rank)
        assert stored_rows == summary["steps_sent"] == NUM_STEPS
    assert "Traceback" not in server.log(), server.log()[-3000:]
    if node_relay:  # the node's batches went in fewer requests than there were batches
        relayed = re.search(r"the node relay sent (\d+) batches .* in (\d+) requests", output)
        assert relayed is not None, output[-2000:]
        num_batches, num_requests = int(relayed[1]), int(relayed[2])
        assert num_batches >= sum(s["batches_sent"] for s in summaries)
        assert num_requests < num_batches
