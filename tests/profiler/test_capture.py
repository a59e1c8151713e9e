"""The training side of deep captures (#21), in one process against a real server: the order
comes in an ingest answer, torch.profiler records the steps and the trace is uploaded; a
capture that cannot be made (no torch.profiler, a full disk, a trace too large) is reported
and training goes on with the same values. One test starts a fresh process: the order, not
the training thread, loads what torch.profiler's first start imports."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

import stepscope
from stepscope.profiler.config import build_config
from stepscope.profiler.telemetry.capture import Order, build_capture
from stepscope.synthetic.generate import JobSpec, generate
from tests.collector.test_captures import live_batches
from tests.live_server import RunningServer, run_server

REGION = "stepscope_test_distinctive_region"
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    env = {"STEPSCOPE_CAPTURE_STEPS": "3", "STEPSCOPE_CAPTURE_MAX_BYTES": "5000000"}
    with run_server(env=env) as running:
        yield running


class Training:
    """A small deterministic model trained one step at a time."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(8, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.num_steps = 0

    def step(self) -> None:
        generator = torch.Generator().manual_seed(self.num_steps)
        x = torch.randn(4, 8, generator=generator)
        with torch.profiler.record_function(REGION):
            loss = nn.functional.mse_loss(self.model(x), x.sum(dim=1, keepdim=True))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.num_steps += 1

    def weights(self) -> list[float]:
        return [v for p in self.model.parameters() for v in p.detach().flatten().tolist()]


def captures_of(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    [request] = client.get(f"/api/v1/jobs/{job_id}/captures").json()
    return list(request["captures"])


def train_through_a_capture(
    server: RunningServer, job_id: str, **options: Any
) -> tuple[Training, dict[str, Any]]:
    """Train with stepscope; ask for a capture of rank 0 after the first batch arrived; keep
    training until the server knows how it ended. The training and the capture."""
    training = Training()
    prof = stepscope.init(job_id=job_id, url=server.url, flush_interval_s=0.1, **options)
    deadline = time.monotonic() + TIMEOUT_S
    with httpx.Client(base_url=server.url, timeout=30) as client:
        asked = False
        while time.monotonic() < deadline:
            with prof.step():
                training.step()
            if not asked:
                response = client.post(f"/api/v1/jobs/{job_id}/captures", json={"rank": 0})
                asked = response.status_code == 201
                continue
            [capture] = captures_of(client, job_id)
            if capture["status"] in ("uploaded", "failed"):
                break
            time.sleep(0.02)
        for _ in range(3):  # steps after the capture
            with prof.step():
                training.step()
        prof.close()
    assert capture["status"] in ("uploaded", "failed"), capture
    return training, capture


def same_training_without_stepscope(num_steps: int) -> list[float]:
    training = Training()
    for _ in range(num_steps):
        training.step()
    return training.weights()


def test_the_order_in_an_ingest_answer_records_the_steps_and_uploads_the_trace(
    server: RunningServer,
) -> None:
    training, capture = train_through_a_capture(server, "capture-inproc")
    assert capture["status"] == "uploaded", capture
    assert capture["role"] == "culprit"
    assert capture["last_step"] - capture["first_step"] == 2  # the server's 3 steps
    names = {op["name"] for op in capture["operators"]}
    assert REGION in names
    assert "aten::addmm" in names or "aten::linear" in names
    assert training.weights() == same_training_without_stepscope(training.num_steps)


def test_capture_max_steps_bounds_what_the_server_asks(server: RunningServer) -> None:
    _, capture = train_through_a_capture(server, "capture-bounded", capture_max_steps=1)
    assert capture["status"] == "uploaded", capture
    assert capture["first_step"] == capture["last_step"]


@pytest.mark.parametrize("failure", ["no torch.profiler", "disk full", "too large"])
def test_a_capture_that_fails_is_reported_and_training_goes_on_unchanged(
    server: RunningServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    failure: str,
) -> None:
    options: dict[str, Any] = {}
    if failure == "no torch.profiler":

        def missing(*_: Any, **__: Any) -> Any:
            raise ImportError("No module named 'torch.profiler' (simulated)")

        monkeypatch.setattr(torch.profiler, "profile", missing)
    elif failure == "disk full":
        not_a_directory = tmp_path / "full"
        not_a_directory.write_text("")
        options["capture_dir"] = str(not_a_directory)
    else:
        options["capture_with_stack"] = True
        monkeypatch.setattr(Order, "of", _tiny_limit(Order.of))
    job_id = f"capture-{failure.replace(' ', '-').replace('.', '')}"
    training, capture = train_through_a_capture(server, job_id, **options)
    assert capture["status"] == "failed"
    expected = {
        "no torch.profiler": "No module named 'torch.profiler' (simulated)",
        "disk full": "NotADirectoryError",
        "too large": "exceeds 200 bytes gzipped",
    }[failure]
    assert expected in capture["error"]
    assert training.weights() == same_training_without_stepscope(training.num_steps)


def _tiny_limit(of: Any) -> Any:
    """Order.of with the server's max_bytes lowered to 200 (a trace is larger)."""

    def tiny(doc: Any, *, max_steps: int) -> Order:
        return of({**doc, "max_bytes": 200}, max_steps=max_steps)

    return tiny


FIRST_START = """
import json, sys
import torch
from stepscope.profiler.telemetry.capture import build_capture
from stepscope.profiler.config import build_config
capture = build_capture(build_config(url="http://127.0.0.1:9", http_timeout_s=1.0))
before = set(sys.modules)
capture.offer({"id": 1, "num_steps": 1, "upload": "/v1/captures/1", "max_bytes": 10**7})
offered = set(sys.modules)
armed = capture.armed
capture.before_step(0)
imported_at_start = sorted(set(sys.modules) - offered)
capture.after_step(0)
capture.close(timeout_s=10)  # recorded and exported; the upload finds no collector
print(json.dumps({"armed": armed, "result": capture.results[1],
                  "by_offer": sorted(offered - before), "by_start": imported_at_start}))
"""


def test_the_order_loads_torch_profiler_so_that_the_training_thread_does_not() -> None:
    # A fresh process: the first start of torch.profiler imports torch._inductor (~1 s, a
    # stall of the rank and of its peers), unless the order's thread has already loaded it.
    out = subprocess.run(
        [sys.executable, "-c", FIRST_START], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["armed"]
    assert seen["result"].startswith("URLError"), seen["result"]
    assert {"torch._inductor", "torch._inductor.config"} <= set(seen["by_offer"])
    heavy = ("torch._inductor", "torch._dynamo", "sympy")
    assert [m for m in seen["by_start"] if m.startswith(heavy)] == []


def test_an_order_that_is_not_one_is_ignored() -> None:
    good = {"id": 4, "num_steps": 30, "upload": "/v1/captures/4", "max_bytes": 10}
    assert Order.of(good, max_steps=20) == Order(4, 20, "/v1/captures/4", 10)
    for bad in (
        [],
        {**good, "id": "4"},
        {**good, "num_steps": 0},
        {**good, "upload": "http://elsewhere/x"},
        {**good, "max_bytes": None},
    ):
        with pytest.raises(ValueError, match="capture"):
            Order.of(bad, max_steps=20)


def test_a_second_order_while_busy_and_an_order_never_started_are_reported(
    server: RunningServer,
) -> None:
    job = generate(JobSpec(job_id="capture-busy", num_ranks=2, num_steps=20, spike_prob=0.0))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for rank in range(2):
            assert client.post("/v1/ingest", json=live_batches(job, rank)[0]).status_code == 200
        asked = [
            client.post("/api/v1/jobs/capture-busy/captures", json={"rank": 1}).json()
            for _ in range(3)
        ]
        first, second, third = (
            next(c["id"] for c in r["captures"] if c["rank"] == 1) for r in asked
        )
        capture = build_capture(build_config(url=server.url))
        assert capture is not None
        for capture_id in (first, second):
            capture.offer(
                {"id": capture_id, "num_steps": 2, "upload": f"/v1/captures/{capture_id}",
                 "max_bytes": 10_000}
            )  # fmt: skip
        capture.close(timeout_s=30)
        capture.offer(
            {"id": third, "num_steps": 2, "upload": f"/v1/captures/{third}", "max_bytes": 10_000}
        )
        rows = {c["id"]: c for r in client.get("/api/v1/jobs/capture-busy/captures").json()
                for c in r["captures"]}  # fmt: skip
    assert rows[second]["status"] == "failed"
    assert rows[second]["error"] == "another capture is in progress on this rank"
    assert rows[first]["status"] == "failed"
    assert rows[first]["error"] == "the job ended before the capture started"
    # An order that comes after the close (in the answer to the last batch) is refused too.
    assert capture.results[third] == "the job ended before the capture started"
    assert not capture.armed
