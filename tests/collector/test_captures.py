"""Deep captures (#21) through a real server on SQLite and PostgreSQL: requested (by the API
or by a straggler finding), told to the rank in the answer to its next batch, the trace
uploaded (bad ones refused whole), listed side by side and downloaded."""

from __future__ import annotations

import gzip
import json
import logging
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stepscope.pipeline.captures import CaptureDesk
from stepscope.schema import Finding
from stepscope.store.engine import make_engine
from stepscope.synthetic.generate import JobSpec, SynthJob, generate
from stepscope.synthetic.hangs import Layout, heartbeats, inject
from stepscope.synthetic.stream import rank_batches
from tests.jobs import STRAGGLER, straggler_job
from tests.live_server import RunningServer, free_port, read_rows, run_server
from tests.support import assert_one_outage_logged

JOB = "capture-job"
HANG_LAYOUT = Layout(dp=4, tp=4, pp=1)
HANG_TS = 1_767_000_000.0
SLOW_FUNCTION = "train.py(42): slow_rank_two_delay"


@pytest.fixture
def server(db_url: str) -> Iterator[RunningServer]:
    env = {"STEPSCOPE_CAPTURE_MAX_BYTES": "200000", "STEPSCOPE_CAPTURE_STEPS": "3"}
    with run_server(db_url, env=env) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def live_batches(job: SynthJob, rank: int, steps_per_batch: int = 20) -> list[dict[str, Any]]:
    """The rank's batches of a job that is still running (no end, no final status)."""
    batches = list(rank_batches(job, rank, steps_per_batch=steps_per_batch))
    for doc in batches:
        doc["job"] = {k: v for k, v in doc["job"].items() if k not in ("status", "ended_at")}
    return batches


def send(client: httpx.Client, doc: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/ingest", json=doc)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def trace(slow_us: float, *, extra: int = 0) -> dict[str, Any]:
    """A Chrome trace: a matmul, the slow function taking `slow_us`, `extra` filler events."""
    events: list[dict[str, Any]] = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 300, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 400, "dur": 100, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "python_function", "name": SLOW_FUNCTION, "ts": 600, "dur": slow_us},
        {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#4", "ts": 0, "dur": 9e6},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
    ]
    events += [
        {"ph": "X", "cat": "cpu_op", "name": f"filler{i}", "ts": i, "dur": 1} for i in range(extra)
    ]
    return {"traceEvents": events, "schemaVersion": 1}


def upload(
    client: httpx.Client, capture_id: int, body: bytes, *, params: Any = None, **headers: str
) -> httpx.Response:
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip", **headers}
    return client.post(f"/v1/captures/{capture_id}", content=body, headers=headers, params=params)


def started_job(client: httpx.Client, num_ranks: int = 4) -> SynthJob:
    """A live job whose every rank has sent its first batch."""
    job = generate(JobSpec(job_id=JOB, num_ranks=num_ranks, num_steps=100, spike_prob=0.0))
    for rank in range(num_ranks):
        assert "capture" not in send(client, live_batches(job, rank)[0])
    return job


def test_a_requested_capture_is_told_once_to_each_rank_then_uploaded_and_compared(
    server: RunningServer, client: httpx.Client
) -> None:
    job = started_job(client)
    response = client.post(f"/api/v1/jobs/{JOB}/captures", json={"rank": 2})
    assert response.status_code == 201, response.text
    request = response.json()
    assert request["reason"] == "user"
    assert request["requested_by"] == "api"
    assert request["num_steps"] == 3  # the server's capture_steps
    by_role = {c["role"]: c for c in request["captures"]}
    assert (by_role["culprit"]["rank"], by_role["reference"]["rank"]) == (2, 0)
    assert {c["status"] for c in request["captures"]} == {"requested"}

    # Ranks 1 and 3 are not asked; 2 and 0 are, in the answer to their next batch, once.
    told = {rank: send(client, live_batches(job, rank)[1]).get("capture") for rank in range(4)}
    assert told[1] is None
    assert told[3] is None
    culprit_id, reference_id = by_role["culprit"]["id"], by_role["reference"]["id"]
    assert told[2] == {
        "id": culprit_id,
        "num_steps": 3,
        "upload": f"/v1/captures/{culprit_id}",
        "max_bytes": 200000,
    }
    assert told[0] is not None
    assert told[0]["id"] == reference_id
    assert "capture" not in send(client, live_batches(job, 2)[2])
    rows = {r["id"]: r for r in read_rows(server.db_url, "captures", JOB)}
    assert rows[culprit_id]["status"] == rows[reference_id]["status"] == "delivered"

    culprit_trace, reference_trace = trace(50_000), trace(1_000)
    culprit_gz = gzip.compress(json.dumps(culprit_trace).encode())
    answer = upload(client, culprit_id, culprit_gz, params={"first_step": 60, "last_step": 62})
    assert answer.status_code == 200, answer.text
    # Sent without gzip: stored gzipped all the same.
    answer = upload(
        client,
        reference_id,
        json.dumps(reference_trace).encode(),
        **{"Content-Encoding": "identity"},
    )
    assert answer.status_code == 200, answer.text

    [listed] = client.get(f"/api/v1/jobs/{JOB}/captures").json()
    captures = {c["role"]: c for c in listed["captures"]}
    culprit = captures["culprit"]
    assert culprit["status"] == "uploaded"
    assert (culprit["first_step"], culprit["last_step"]) == (60, 62)
    assert culprit["trace_bytes"] == len(culprit_gz)
    operators = {op["name"]: op for op in culprit["operators"]}
    assert operators[SLOW_FUNCTION]["total_s"] == pytest.approx(0.05)
    assert operators["aten::mm"] == {
        "name": "aten::mm",
        "category": "cpu_op",
        "count": 2,
        "total_s": pytest.approx(400e-6),
    }
    assert "ProfilerStep#4" not in operators  # the profiler's own step spans are left out
    top = listed["comparison"][0]
    assert top["name"] == SLOW_FUNCTION
    assert top["difference_s"] == pytest.approx(0.049)
    assert top["culprit_s"] == pytest.approx(0.05)
    assert top["reference_s"] == pytest.approx(0.001)

    downloaded = client.get(culprit["download"])
    assert downloaded.status_code == 200
    assert downloaded.headers["content-type"] == "application/gzip"
    assert f"rank2-capture{culprit_id}" in downloaded.headers["content-disposition"]
    assert json.loads(gzip.decompress(downloaded.content)) == culprit_trace
    reference = client.get(captures["reference"]["download"])
    assert json.loads(gzip.decompress(reference.content)) == reference_trace

    again = upload(client, culprit_id, culprit_gz)
    assert again.status_code == 409
    assert "already" in again.json()["detail"]


def test_bad_uploads_are_refused_whole_naming_the_problem(
    server: RunningServer, client: httpx.Client
) -> None:
    job = started_job(client, num_ranks=2)
    request = client.post(f"/api/v1/jobs/{JOB}/captures", json={"rank": 1}).json()
    capture_id = next(c["id"] for c in request["captures"] if c["role"] == "culprit")
    send(client, live_batches(job, 1)[1])
    good = gzip.compress(json.dumps(trace(100)).encode())
    cases: list[tuple[httpx.Response, int, str]] = [
        (upload(client, capture_id, b"not gzip"), 400, "gzip"),
        (upload(client, capture_id, gzip.compress(b"{not json")), 400, "JSON"),
        (upload(client, capture_id, gzip.compress(b"[1, 2]")), 422, "traceEvents"),
        (upload(client, capture_id, gzip.compress(b'{"traceEvents": {}}')), 422, "traceEvents"),
        (
            upload(client, capture_id, gzip.compress(b'{"traceEvents": [{"ph": "M"}]}')),
            422,
            "complete events",
        ),
        (
            upload(client, capture_id, gzip.compress(json.dumps(trace(1, extra=90_000)).encode())),
            413,
            "200000",
        ),
        (upload(client, capture_id, good, **{"Content-Type": "text/plain"}), 415, "Content-Type"),
        (upload(client, capture_id, good, params={"first_step": "x"}), 422, "first_step"),
        (
            upload(client, capture_id, good, params={"first_step": 9, "last_step": 3}),
            422,
            "last_step",
        ),
        (upload(client, 999_999, good), 404, "999999"),
        (upload(client, 10**12, good), 404, "1000000000000"),
        (upload(client, capture_id, good, **{"Content-Encoding": "br"}), 415, "Content-Encoding"),
    ]
    for response, status, named in cases:
        assert response.status_code == status, (status, response.text)
        assert named in response.json()["detail"], response.text
    [row] = [r for r in read_rows(server.db_url, "captures", JOB) if r["id"] == capture_id]
    assert row["status"] == "delivered"
    assert row["trace_gz"] is None
    assert row["summary"] is None
    assert row["trace_bytes"] is None
    assert client.get(f"/api/v1/captures/{capture_id}/trace").status_code == 404


def test_a_rank_that_gives_up_says_why(server: RunningServer, client: httpx.Client) -> None:
    started_job(client, num_ranks=2)
    request = client.post(f"/api/v1/jobs/{JOB}/captures", json={"rank": 0}).json()
    capture_id = request["captures"][0]["id"]
    bad = client.post(f"/v1/captures/{capture_id}/failure", json={"error": ""})
    assert bad.status_code == 422
    assert "error" in bad.json()["detail"]
    response = client.post(
        f"/v1/captures/{capture_id}/failure", json={"error": "OSError: No space left on device"}
    )
    assert response.status_code == 200, response.text
    [listed] = client.get(f"/api/v1/jobs/{JOB}/captures").json()
    mine = next(c for c in listed["captures"] if c["id"] == capture_id)
    assert mine["status"] == "failed"
    assert mine["error"] == "OSError: No space left on device"
    assert mine["download"] is None
    assert listed["comparison"] == []


def test_a_request_naming_what_does_not_exist_is_refused(client: httpx.Client) -> None:
    started_job(client, num_ranks=2)
    unknown_job = client.post("/api/v1/jobs/no-such-job/captures", json={"rank": 0})
    assert unknown_job.status_code == 404
    cases = [
        ({"rank": 7}, "rank"),
        ({"rank": 0, "reference_rank": 0}, "reference_rank"),
        ({"rank": 0, "num_steps": 51}, "num_steps"),
        ({"rank": -1}, "rank"),
        ({"rank": 0, "steps": 3}, "steps"),
    ]
    for body, named in cases:
        response = client.post(f"/api/v1/jobs/{JOB}/captures", json=body)
        assert response.status_code == 422, response.text
        assert named in response.json()["detail"]
    assert client.get(f"/api/v1/jobs/{JOB}/captures").json() == []


def test_a_straggler_finding_on_a_live_job_asks_for_a_capture_of_it(
    server: RunningServer, client: httpx.Client
) -> None:
    """The automatic path: the analysis finds rank STRAGGLER slow and the server asks it (and
    a reference rank) in the answer to its next batch; once per rank, and only while the job
    runs."""
    job = straggler_job(JOB, num_ranks=8, num_steps=400)
    for rank in range(8):
        for doc in live_batches(job, rank, steps_per_batch=100):
            assert "capture" not in send(client, doc)
    findings = client.post(f"/api/v1/jobs/{JOB}/analyze").json()
    assert any(f["kind"] == "straggler_rank" and f["ranks"] == [STRAGGLER] for f in findings)
    [request] = client.get(f"/api/v1/jobs/{JOB}/captures").json()
    assert request["requested_by"] == "analysis"
    assert request["reason"] == "straggler_rank"
    assert request["finding"]["ranks"] == [STRAGGLER]
    by_role = {c["role"]: c["rank"] for c in request["captures"]}
    assert by_role == {"culprit": STRAGGLER, "reference": 0}
    told = send(client, live_batches(job, STRAGGLER, steps_per_batch=100)[-1])
    assert told["capture"]["num_steps"] == 3
    # A second pass finds it again: no second capture of the same rank.
    client.post(f"/api/v1/jobs/{JOB}/analyze")
    assert len(client.get(f"/api/v1/jobs/{JOB}/captures").json()) == 1


def test_a_finished_job_is_not_captured(client: httpx.Client) -> None:
    job = straggler_job(JOB, num_ranks=8, num_steps=400)
    for rank in range(8):
        for doc in rank_batches(job, rank, steps_per_batch=100):  # rank 0 ends the job
            send(client, doc)
    client.post(f"/api/v1/jobs/{JOB}/analyze")
    assert client.get(f"/api/v1/jobs/{JOB}/captures").json() == []


def test_a_hang_on_a_live_job_asks_for_a_capture_of_its_culprit(
    server: RunningServer, client: httpx.Client
) -> None:
    """The hang monitor's finding goes to the same hook: its culprit (and a reference rank)
    are asked, to record once the job moves again."""
    job_id = "capture-hang"
    job = generate(JobSpec(job_id=job_id, num_ranks=16, num_steps=40, spike_prob=0.0))
    for rank in range(16):
        send(client, live_batches(job, rank)[0])
    hang = inject(
        HANG_LAYOUT, job_id, "never_entered", 1, ts=HANG_TS + 1, step=30, base_seq=100,
        rng=random.Random(2),
    )  # fmt: skip
    (culprit,) = hang.culprits
    for doc in [*heartbeats(HANG_LAYOUT, job_id, ts=HANG_TS, step=30, base_seq=100),
                *hang.heartbeats, *hang.reports]:  # fmt: skip
        assert client.post("/v1/hangs", json=doc).status_code == 200

    def asked() -> list[dict[str, Any]]:
        return list(client.get(f"/api/v1/jobs/{job_id}/captures").json())

    deadline = time.monotonic() + 30
    while not asked() and time.monotonic() < deadline:
        time.sleep(0.1)
    [request] = asked()
    assert (request["reason"], request["requested_by"]) == ("hang", "analysis")
    by_role = {c["role"]: c["rank"] for c in request["captures"]}
    assert by_role == {"culprit": culprit, "reference": 0 if culprit != 0 else 1}
    assert request["finding"]["kind"] == "hang"


def test_an_outage_while_asking_for_a_capture_is_one_outage_line_not_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/down")
    desk = CaptureDesk(engine, num_steps=5, max_steps=50, auto=True, max_auto_per_job=2)
    finding = Finding(
        job_id="down",
        kind="straggler_rank",
        severity="warning",
        ranks=[3],
        node="node-0000",
        first_step=10,
        metric="compute_s",
        cause="compute",
        effect=0.2,
    )
    with caplog.at_level(logging.WARNING):
        desk.on_findings("down", [finding])  # the findings hook never raises
        desk.on_findings("down", [finding])
    engine.dispose()
    assert_one_outage_logged(caplog)
