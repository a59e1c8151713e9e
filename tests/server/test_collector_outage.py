"""The collector unreachable in the middle of a job, killed (connections refused) or stopped
(connections accepted, never answered): what the profilers buffered arrives after, once; with
buffers smaller than the outage, exactly what is missing is counted and reported."""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.live_server import ServerProcess, read_rows
from tests.shipping_job import ShippingJob

NUM_RANKS, NUM_STEPS, STEPS_PER_S, OUTAGE_S = 4, 160, 20.0, 3.0
SMALL_BUFFERS = {"max_buffer_rows": 10, "max_batch_rows": 5, "max_pending_batches": 1}
"""Room for 15 step rows per rank: an outage of OUTAGE_S at STEPS_PER_S overflows it."""
OUTAGES = ("refused", "hung")
HUNG_HTTP_TIMEOUT_S = 1.0
"""Shorter than the outage: requests to the stopped collector time out and are sent again,
while the server answers the first copies once it runs again."""


@contextmanager
def job_with_outage(
    tmp_path: Path, job_id: str, outage: str, **config: Any
) -> Iterator[ShippingJob]:
    """Stream a job, take its collector away for OUTAGE_S from step 40 and back ("refused":
    SIGKILL, then a new server; "hung": SIGSTOP, then SIGCONT); the job, after every rank
    closed, while the collector serves again at job.url."""
    server = ServerProcess(f"sqlite:///{tmp_path / 'stepscope.db'}", log_path=tmp_path / "log")
    if outage == "hung":
        config["http_timeout_s"] = HUNG_HTTP_TIMEOUT_S
    with server:
        yield _stream(server, job_id, outage, **config)


def _stream(server: ServerProcess, job_id: str, outage: str, **config: Any) -> ShippingJob:
    job = ShippingJob(
        [server.url],
        job_id=job_id,
        num_ranks=NUM_RANKS,
        num_steps=NUM_STEPS,
        steps_per_s=STEPS_PER_S,
        backoff_max_s=0.5,
        **config,
    )
    job.start()
    job.wait_for_step(40)
    if outage == "hung":
        server.pause()
    else:
        server.kill()
    time.sleep(OUTAGE_S)
    if outage == "hung":
        server.resume()
    else:
        server.start()
    assert all(job.finish())
    return job


def steps_by_rank(db_url: str, job_id: str) -> Counter[int]:
    return Counter(r["rank"] for r in read_rows(db_url, "steps", job_id))


@pytest.mark.parametrize("outage", OUTAGES)
def test_what_was_buffered_during_an_outage_arrives_after_it(tmp_path: Path, outage: str) -> None:
    with job_with_outage(tmp_path, "outage-buffered", outage) as job:
        pass
    db_url = f"sqlite:///{tmp_path / 'stepscope.db'}"
    stored = Counter((r["rank"], r["step"]) for r in read_rows(db_url, "steps", job.job_id))
    assert dict(stored) == dict.fromkeys(ShippingJob.expected_steps(NUM_RANKS, NUM_STEPS), 1)
    assert all(sum(d.values()) == 0 for d in job.dropped())
    assert sum(s.stats.num_retries for s in job.shippers) > 0, "the outage was not seen"
    assert all(s.idle for s in job.shippers), "nothing is left unsent in memory"


@pytest.mark.parametrize("outage", OUTAGES)
def test_with_buffers_smaller_than_the_outage_the_drop_count_is_exactly_what_is_missing(
    tmp_path: Path, outage: str
) -> None:
    with job_with_outage(tmp_path, "outage-dropped", outage, **SMALL_BUFFERS) as job:
        url = job.urls[0]
        with urllib.request.urlopen(f"{url}/api/v1/jobs/{job.job_id}", timeout=30) as r:
            summary = json.loads(r.read())
    db_url = f"sqlite:///{tmp_path / 'stepscope.db'}"
    stored = steps_by_rank(db_url, job.job_id)
    reports = [
        e for e in read_rows(db_url, "events", job.job_id) if e["message"].startswith("stepscope")
    ]
    reported: Counter[int] = Counter()
    for event in reports:
        attributes = event["attributes"]
        attributes = json.loads(attributes) if isinstance(attributes, str) else attributes
        reported[event["rank"]] += attributes["dropped_steps"]
    for rank, shipper in enumerate(job.shippers):
        dropped = shipper.stats.num_dropped["steps"]
        assert dropped > 0, "the buffers were not smaller than the outage"
        assert stored[rank] + dropped == job.produced[rank] == NUM_STEPS
        assert reported[rank] == dropped
    assert summary["num_records_dropped"] == NUM_RANKS * NUM_STEPS - sum(stored.values())
