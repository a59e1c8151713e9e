"""Deep capture end to end (#21): a real torchrun job (gloo, 4 ranks) whose rank 2 is slowed
inside `slow_rank_two_delay`. The straggler finding asks rank 2 and a reference rank for a
torch.profiler capture in the answer to their next batch; both traces arrive, and the
culprit's names the function. A capture that fails (torch.profiler raising) leaves training
as it was: every step done, the weights those of training without any capture.

No wall-clock bound is asserted (a loaded 2-core machine); how long things took goes to
stderr.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from tests.live_server import RunningServer, read_rows, run_server
from tests.profiler import capture_job
from tests.support import require_torchrun

pytestmark = pytest.mark.torchrun

REPO = Path(__file__).resolve().parents[2]
NUM_RANKS = 4
NUM_STEPS = 3
TIMEOUT_S = 240.0
AUTO_TIMEOUT_S = 150.0
"""How long the test waits for the analysis to find the straggler before it asks itself."""


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(env={"STEPSCOPE_CAPTURE_STEPS": str(NUM_STEPS)}) as running:
        yield running


def launch(server: RunningServer, job_id: str, out: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    env.update(OMP_NUM_THREADS="1", STEPSCOPE_URL=server.url, STEPSCOPE_JOB_ID=job_id)
    cmd = [require_torchrun(), "--standalone", f"--nproc_per_node={NUM_RANKS}"]
    cmd += [str(Path(capture_job.__file__)), "--out", str(out), *args]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for(what: str, check: Callable[[], Any], proc: subprocess.Popen[str]) -> Any:
    """Poll until `check` returns something truthy; it. Fails when the job ends first."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"the job ended (exit {proc.returncode}) before {what}:\n{out[-4000:]}")
        time.sleep(0.5)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def finish(proc: subprocess.Popen[str], out: Path) -> dict[int, dict[str, Any]]:
    """Tell the job to stop after its next step; each rank's final document."""
    (out / "stop").touch()
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    assert proc.returncode == 0, output[-4000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(NUM_RANKS)}


def expected_weights(num_steps: int) -> list[torch.Tensor]:
    """The weights of the same training without stepscope: SGD on the ranks' mean gradient."""
    model = capture_job.build_model()
    for step in range(num_steps):
        model.zero_grad()
        for rank in range(NUM_RANKS):
            x, y = capture_job.batch(step, rank)
            (nn.functional.mse_loss(model(x), y) / NUM_RANKS).backward()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p -= capture_job.LEARNING_RATE * p.grad
    return [p.detach().flatten() for p in model.parameters()]


def assert_trained_as_without_capture(
    done: dict[int, dict[str, Any]], server: RunningServer, job_id: str
) -> None:
    """Every rank did the same steps, all stored, and ended with the recomputed weights."""
    [num_steps] = {doc["num_steps"] for doc in done.values()}
    expected = expected_weights(num_steps)
    for doc in done.values():
        for got, want in zip(doc["weights"], expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
    steps = read_rows(server.db_url, "steps", job_id)
    for rank in range(NUM_RANKS):
        assert sorted(r["step"] for r in steps if r["rank"] == rank) == list(range(num_steps))


def requests(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/api/v1/jobs/{job_id}/captures")
    return response.json() if response.status_code == 200 else []


def note(message: str) -> None:
    sys.stderr.write(f"{message}\n")


def test_the_straggler_is_captured_and_its_trace_names_the_slow_function(
    server: RunningServer, tmp_path: Path
) -> None:
    job_id = "capture-torchrun"
    proc = launch(server, job_id, tmp_path)
    started = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=120) as client:

        def analysed_request() -> list[dict[str, Any]]:
            if len({r["rank"] for r in read_rows(server.db_url, "ranks", job_id)}) < NUM_RANKS:
                return []
            client.post(f"/api/v1/jobs/{job_id}/analyze")  # what the background pass does
            return requests(client, job_id)

        deadline = time.monotonic() + AUTO_TIMEOUT_S
        found: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the job ended before the capture was asked"
            found = analysed_request()
            if found:
                break
            time.sleep(1.0)
        if found:
            [request] = found
            assert request["requested_by"] == "analysis"
            assert request["reason"] in ("straggler_rank", "straggler_node")
        else:  # the analysis did not find it in time on this machine: ask, as a user would
            note(f"no straggler finding after {AUTO_TIMEOUT_S} s: requesting the capture")
            response = client.post(f"/api/v1/jobs/{job_id}/captures", json={"rank": 2})
            assert response.status_code == 201, response.text
        note(f"capture requested {time.monotonic() - started:.1f} s after launch")

        def uploaded() -> dict[str, Any] | None:
            [request] = requests(client, job_id)
            statuses = {c["status"] for c in request["captures"]}
            assert "failed" not in statuses, request
            return request if statuses == {"uploaded"} else None

        request = wait_for("both traces", uploaded, proc)
        note(f"both traces stored {time.monotonic() - started:.1f} s after launch")
        by_role = {c["role"]: c for c in request["captures"]}
        assert by_role["culprit"]["rank"] == capture_job.SLOW_RANK
        assert by_role["reference"]["rank"] != capture_job.SLOW_RANK
        traces = {}
        for role, capture in by_role.items():
            assert capture["last_step"] - capture["first_step"] + 1 == NUM_STEPS
            body = client.get(capture["download"])
            assert body.status_code == 200
            traces[role] = json.loads(gzip.decompress(body.content))

    def slow_events(doc: dict[str, Any]) -> list[str]:
        names = (e.get("name", "") for e in doc["traceEvents"] if e.get("ph") == "X")
        return [name for name in names if "slow_rank_two_delay" in name]

    assert slow_events(traces["culprit"]), "the culprit's trace does not name the function"
    assert not slow_events(traces["reference"])
    [row] = [d for d in request["comparison"] if "slow_rank_two_delay" in d["name"]]
    # It slept DELAY_S in each recorded step; the reference never ran it.
    assert row["culprit_s"] >= NUM_STEPS * capture_job.DELAY_S * 0.99
    assert row["reference_s"] == 0.0
    done = finish(proc, tmp_path)
    assert_trained_as_without_capture(done, server, job_id)


def test_a_capture_that_fails_leaves_training_as_it_was(
    server: RunningServer, tmp_path: Path
) -> None:
    job_id = "capture-torchrun-broken"
    proc = launch(server, job_id, tmp_path, "--break-profiler")
    with httpx.Client(base_url=server.url, timeout=120) as client:

        def asked() -> bool:
            if len({r["rank"] for r in read_rows(server.db_url, "ranks", job_id)}) < NUM_RANKS:
                return False
            response = client.post(f"/api/v1/jobs/{job_id}/captures", json={"rank": 2})
            return response.status_code == 201

        wait_for("the job's ranks to report", asked, proc)

        def failed() -> dict[str, Any] | None:
            [request] = requests(client, job_id)
            done = all(c["status"] == "failed" for c in request["captures"])
            return request if done else None

        request = wait_for("both captures to fail", failed, proc)
    assert sorted(c["role"] for c in request["captures"]) == ["culprit", "reference"]
    for capture in request["captures"]:
        assert "No space left on device (simulated)" in capture["error"]
        assert capture["download"] is None
    done = finish(proc, tmp_path)
    assert_trained_as_without_capture(done, server, job_id)
