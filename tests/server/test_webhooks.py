"""Webhooks against a real local receiver: delivered once, retried after a 500, signed."""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import httpx
import sqlalchemy as sa

from stepscope.schema import Finding
from stepscope.server.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, WebhookSender
from stepscope.store.engine import make_engine
from stepscope.synthetic.stream import stream_job
from tests.api.conftest import JOB, main_job
from tests.jobs import STRAGGLER
from tests.live_server import read_rows, run_server
from tests.server.webhook_receiver import Received, webhook_receiver

SECRET = "s3cret"


def straggler(severity: str = "critical") -> Finding:
    return Finding(
        job_id="job-w",
        kind="straggler_rank",
        severity=severity,  # type: ignore[arg-type]
        ranks=[5],
        node="node-0",
        first_step=200,
        metric="step_s",
        effect=0.05,
        cause="compute",
        evidence={"component": "compute_s", "rank_median_s": 0.5, "peers_median_s": 0.4},
    )


def signed(request: Received) -> bool:
    digest = hmac.new(SECRET.encode(), request.body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(request.headers[SIGNATURE_HEADER.lower()], f"sha256={digest}")


def sender(engine: sa.Engine, url: str, **kwargs: object) -> WebhookSender:
    options: dict[str, object] = {"timeout_s": 5.0, "backoff_s": 0.05, "poll_s": 0.05}
    return WebhookSender(engine, [url], secret=SECRET, **{**options, **kwargs})  # type: ignore[arg-type]


def test_a_finding_is_delivered_once_retried_after_a_500_and_signed(db_url: str) -> None:
    engine = make_engine(db_url)
    with webhook_receiver() as receiver:
        receiver.statuses = [500]
        hooks = sender(engine, receiver.url)
        hooks.start()
        try:
            hooks.offer("job-w", [straggler()])
            receiver.wait_for(lambda r: len(r) >= 2)
            hooks.offer("job-w", [straggler()])  # the next analysis pass offers it again
            time.sleep(0.5)
        finally:
            hooks.stop()
        restarted = sender(engine, receiver.url)  # a server restart
        restarted.start()
        try:
            restarted.offer("job-w", [straggler()])
            time.sleep(0.5)
        finally:
            restarted.stop()

    first, second = receiver.requests
    assert (first.status, second.status) == (500, 200)
    assert first.body == second.body
    assert first.headers[DELIVERY_HEADER.lower()] == second.headers[DELIVERY_HEADER.lower()]
    assert signed(second)
    doc = json.loads(second.body)
    assert doc["text"].startswith("stepscope: job job-w: critical")
    assert "rank 5 (node-0)" in doc["text"]
    assert doc["finding"]["kind"] == "straggler_rank"
    assert doc["finding"]["ranks"] == [5]
    assert doc["finding"]["cause"] == "compute"
    (row,) = read_rows(db_url, "webhook_deliveries", "job-w")
    assert row["attempts"] == 2
    assert row["delivered_at"] is not None
    assert row["next_attempt_at"] is None
    assert receiver.url not in repr(row), "the URL (a secret for Slack) is stored hashed"
    engine.dispose()


def test_stop_wakes_the_thread_from_its_wait_for_offers(db_url: str) -> None:
    engine = make_engine(db_url)
    with webhook_receiver() as receiver:
        hooks = sender(engine, receiver.url, poll_s=60.0)
        hooks.start()
        hooks.offer("job-w", [straggler()])
        receiver.wait_for(lambda r: len(r) == 1)  # then it waits up to poll_s for offers
        hooks.stop()  # joins for timeout_s + 5 s at most
        assert hooks._thread is not None
        assert not hooks._thread.is_alive()
    engine.dispose()


def test_an_escalation_to_critical_is_notified_again(db_url: str) -> None:
    engine = make_engine(db_url)
    with webhook_receiver() as receiver:
        hooks = sender(engine, receiver.url)
        hooks.start()
        try:
            hooks.offer("job-w", [straggler("info"), straggler("warning")])  # info: not sent
            receiver.wait_for(lambda r: len(r) == 1)
            hooks.offer("job-w", [straggler("warning"), straggler("critical")])
            receiver.wait_for(lambda r: len(r) == 2)
            time.sleep(0.3)
        finally:
            hooks.stop()
    severities = [json.loads(r.body)["finding"]["severity"] for r in receiver.requests]
    assert severities == ["warning", "critical"]
    engine.dispose()


def test_a_refused_webhook_is_given_up_without_retrying(db_url: str) -> None:
    engine = make_engine(db_url)
    with webhook_receiver() as receiver:
        receiver.statuses = [400]
        hooks = sender(engine, receiver.url)
        hooks.start()
        try:
            hooks.offer("job-w", [straggler()])
            receiver.wait_for(lambda r: len(r) == 1)
            time.sleep(0.5)
        finally:
            hooks.stop()
    assert len(receiver.requests) == 1
    (row,) = read_rows(db_url, "webhook_deliveries", "job-w")
    assert (row["delivered_at"], row["next_attempt_at"]) == (None, None)
    assert row["last_error"].startswith("HTTP 400")
    engine.dispose()


def test_a_down_receiver_does_not_block_the_analysis(db_url: str) -> None:
    engine = make_engine(db_url)
    hooks = sender(engine, "http://127.0.0.1:9/unreachable", max_attempts=2)
    hooks.start()
    try:
        t0 = time.perf_counter()
        for _ in range(2000):
            hooks.offer("job-w", [straggler()])
        offered_s = time.perf_counter() - t0
    finally:
        hooks.stop()
    assert offered_s < 0.5
    engine.dispose()


def test_the_server_posts_new_findings_of_an_analysis(db_url: str) -> None:
    with webhook_receiver() as receiver:
        env = {"STEPSCOPE_WEBHOOK_URLS": receiver.url, "STEPSCOPE_WEBHOOK_SECRET": SECRET}
        with run_server(db_url, env=env) as server:
            assert not stream_job(main_job(), server.url, steps_per_batch=50).failures
            url = f"{server.url}/api/v1/jobs/{JOB}"
            found = httpx.post(f"{url}/analyze", timeout=120).json()
            alarming = [f for f in found if f["severity"] != "info"]
            receiver.wait_for(lambda r: len(r) >= len(alarming))
            httpx.post(f"{url}/analyze", params={"full": True}, timeout=120)
            time.sleep(1.0)  # a second pass (new rows, same findings) sends nothing more

    docs = [json.loads(r.body) for r in receiver.requests]
    assert len(docs) == len(alarming)
    assert all(signed(r) for r in receiver.requests)
    assert sorted(d["finding"]["kind"] for d in docs) == sorted(f["kind"] for f in alarming)
    (stragglers,) = [d for d in docs if d["finding"]["kind"] == "straggler_rank"]
    assert f"rank {STRAGGLER} (node-0001)" in stragglers["text"]
    assert stragglers["finding"]["text"] in stragglers["text"]
