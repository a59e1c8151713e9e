"""Two `stepscope serve` replicas on one PostgreSQL behind a load balancer, one killed in the
middle of the stream: every row stored once, each job analysed in one place at a time and
handed over, each webhook delivered once, both replicas answering the same."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from stepscope.pipeline.job_pass import analyze_stored_job
from stepscope.store import findings
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.synthetic.stream import StreamStats, batch_rounds, post_bodies
from tests.balancer import round_robin
from tests.jobs import NUM_RANKS, NUM_STEPS, STRAGGLER, straggler_job
from tests.live_server import ServerProcess, read_rows
from tests.server.webhook_receiver import webhook_receiver
from tests.support import fresh_postgres_database

JOBS = ("replicated-1", "replicated-2")
ROUND_INTERVAL_S = 0.6


def _get(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=30) as response:
        return json.loads(response.read())


def _wait_until(what: str, condition: Any, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _analysed_whole(url: str, job_id: str) -> bool:
    summary = _get(url, f"/api/v1/jobs/{job_id}")
    if summary["num_steps"] != NUM_STEPS:
        return False
    kinds = {(f["kind"], tuple(f["ranks"])) for f in _get(url, f"/api/v1/jobs/{job_id}/findings")}
    return ("straggler_rank", (STRAGGLER,)) in kinds


def _finding_values(engine: Any, job_id: str) -> list[tuple[Any, ...]]:
    return sorted(
        (f.kind, tuple(f.ranks), f.first_step, f.cause, f.severity)
        for f in findings.load_findings(engine, job_id)
    )


def test_two_replicas_one_killed_mid_stream_store_analyse_and_notify_once(
    tmp_path: Path,
) -> None:
    rounds = [
        a + b
        for a, b in zip(
            *(batch_rounds(straggler_job(job_id), steps_per_batch=50) for job_id in JOBS),
            strict=True,
        )
    ]
    with fresh_postgres_database() as db_url, webhook_receiver() as receiver:
        engine = make_engine(db_url)
        upgrade(engine)
        args = ["--analyze-interval", "0.5", "--webhook", receiver.url]
        env = {"STEPSCOPE_ROLLUP_GRACE_S": "1"}
        a, b = (
            ServerProcess(db_url, log_path=tmp_path / f"{name}.log", extra_args=args, env=env)
            for name in ("a", "b")
        )
        with a, b, round_robin([a.port, b.port]) as balancer:
            sent: list[StreamStats] = []
            streaming = threading.Thread(
                target=lambda: sent.append(
                    asyncio.run(
                        post_bodies(
                            balancer, rounds, concurrency=16, round_interval_s=ROUND_INTERVAL_S
                        )
                    )
                )
            )
            streaming.start()
            time.sleep(ROUND_INTERVAL_S * 3.5)  # in the middle of the stream
            a.kill()
            streaming.join(timeout=120)
            for job_id in JOBS:  # replica b took the jobs over
                _wait_until(f"{job_id} analysed", lambda j=job_id: _analysed_whole(b.url, j))
            receiver.wait_for(
                lambda got: (
                    {r.headers["x-stepscope-delivery"][:12] for r in got} >= {j[:12] for j in JOBS}
                )
            )
            a.start()  # back on the same database: nothing to redo, nothing to resend
            time.sleep(3.0)
            answers = {
                server.url: [
                    _get(server.url, f"/api/v1/jobs/{job_id}{path}")
                    for job_id in JOBS
                    for path in ("", "/findings", "/ranks")
                ]
                for server in (a, b)
            }
            incremental = {job_id: _finding_values(engine, job_id) for job_id in JOBS}
        logs = {"a": a.log(), "b": b.log()}
        stored = {
            job_id: Counter((r["rank"], r["step"]) for r in read_rows(db_url, "steps", job_id))
            for job_id in JOBS
        }
        for job_id in JOBS:
            analyze_stored_job(engine, job_id, full=True, grace_s=0.0)
        full = {job_id: _finding_values(engine, job_id) for job_id in JOBS}
        engine.dispose()

    [stats] = sent
    assert stats.failures == []
    assert stats.batches == len(rounds) * len(rounds[0])
    for job_id in JOBS:
        assert len(stored[job_id]) == NUM_RANKS * NUM_STEPS
        assert set(stored[job_id].values()) == {1}
    # Each finding was delivered once, though both replicas analysed and notified.
    deliveries = Counter(r.headers["x-stepscope-delivery"] for r in receiver.requests)
    assert deliveries, "no webhook was delivered"
    assert set(deliveries.values()) == {1}, deliveries
    # Both replicas answer the same, and the passes spread over them (and handed over) stored
    # what one full analysis stores.
    assert answers[a.url] == answers[b.url]
    assert incremental == full
    for name, log in logs.items():
        assert "Traceback" not in log, (name, log[-3000:])
