"""The database down under a streaming job: 503 with Retry-After (never 500), one log line,
recovery by itself, and every row stored exactly once after the profilers resent them."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from tests.live_server import ServerProcess, post_batch, read_rows
from tests.shipping_job import ShippingJob
from tests.support import throwaway_postgres

NUM_RANKS, NUM_STEPS, STEPS_PER_S = 8, 200, 20.0
PROBED = ("/healthz", "/api/v1/jobs", "/api/v1/jobs/outage")


class Prober:
    """GETs a few routes in a loop and counts the answers (status, Retry-After)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: Counter[tuple[int, str | None]] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for path in PROBED:
                try:
                    with urllib.request.urlopen(self.url + path, timeout=10) as response:
                        self.answers[(response.status, None)] += 1
                except urllib.error.HTTPError as exc:
                    self.answers[(exc.code, exc.headers.get("Retry-After"))] += 1
                except OSError:
                    self.answers[(0, None)] += 1

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _stored_keys(db_url: str, job_id: str) -> Counter[tuple[int, int]]:
    return Counter((r["rank"], r["step"]) for r in read_rows(db_url, "steps", job_id))


def _batches_by_rank(db_url: str, job_id: str) -> Counter[int]:
    return Counter(r["rank"] for r in read_rows(db_url, "ingest_batches", job_id))


def test_postgresql_restarted_mid_job_answers_503_then_stores_every_row_once(
    tmp_path: Path,
) -> None:
    with throwaway_postgres() as pg:
        engine = make_engine(pg.url)
        upgrade(engine)
        engine.dispose()
        server = ServerProcess(
            pg.url,
            log_path=tmp_path / "server.log",
            extra_args=["--analyze-interval", "0.5"],  # the analyzer meets the outage too
            env={"STEPSCOPE_RETRY_AFTER_S": "1"},
        )
        with server, Prober(server.url) as prober:
            job = ShippingJob(
                [server.url],
                job_id="outage",
                num_ranks=NUM_RANKS,
                num_steps=NUM_STEPS,
                steps_per_s=STEPS_PER_S,
            )
            job.start()
            job.wait_for_step(40)
            pg.stop()
            down = Counter(prober.answers)
            time.sleep(3.0)
            down = prober.answers - down
            pg.start()
            acknowledged = job.finish()
            time.sleep(1.0)  # the prober sees the recovery
            stored = _stored_keys(pg.url, "outage")
            batches = _batches_by_rank(pg.url, "outage")
        log = server.log()

    # While it was down: 503s that say when to retry, and nothing else.
    assert down[(503, "1")] > 0, down
    assert {status for status, _ in prober.answers} <= {200, 503, 404}, prober.answers
    assert all(retry == "1" for status, retry in prober.answers if status == 503)
    # It came back by itself.
    assert prober.answers[(200, None)] > down[(200, None)]
    # The profilers waited as asked and resent: every row once, every acknowledged batch once.
    assert all(acknowledged)
    assert job.produced == [NUM_STEPS] * NUM_RANKS
    assert sum(s.stats.num_retry_after for s in job.shippers) > 0
    assert dict(stored) == dict.fromkeys(ShippingJob.expected_steps(NUM_RANKS, NUM_STEPS), 1)
    assert [batches[r] for r in range(NUM_RANKS)] == job.batches_sent()
    assert all(sum(d.values()) == 0 for d in job.dropped())
    # One line for the outage and one for the recovery; no traceback, no 500.
    assert "Traceback" not in log, log[-3000:]
    assert log.count("database unavailable") == 1, log[-3000:]
    assert log.count("database available again") == 1, log[-3000:]


ACCEPTED = {"steps": 1, "collectives": 0, "gpu": 0, "events": 0}


def _post_batch(url: str) -> dict[str, object]:
    """POST one batch of one step row; the collector's answer."""
    return post_batch(
        url,
        {
            "schema": 1,
            "job": {"job_id": "locked-probe", "world_size": 1},
            "source": {"rank": 0, "incarnation": "probe"},
            "seq": 0,
            "steps": {"step": [0], "ts": [1.7e9], "step_s": [0.1], "data_s": [0.0]},
        },
    )


def test_a_locked_sqlite_database_answers_503_and_recovers(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'stepscope.db'}"
    engine = make_engine(db_url)
    upgrade(engine)
    server = ServerProcess(
        db_url,
        log_path=tmp_path / "server.log",
        env={"STEPSCOPE_RETRY_AFTER_S": "1", "STEPSCOPE_SQLITE_BUSY_TIMEOUT_S": "0.5"},
    )
    with server:
        job = ShippingJob(
            [server.url], job_id="locked", num_ranks=4, num_steps=60, steps_per_s=STEPS_PER_S
        )
        job.start()
        job.wait_for_step(10)
        with engine.connect() as conn:
            conn.exec_driver_sql("BEGIN EXCLUSIVE")  # another process holds the write lock
            try:
                with pytest.raises(urllib.error.HTTPError) as answer:
                    _post_batch(server.url)
                time.sleep(1.0)
            finally:
                conn.exec_driver_sql("ROLLBACK")
        acknowledged = job.finish()
        assert _post_batch(server.url) == {"accepted": ACCEPTED, "duplicate": False}
    log = server.log()
    engine.dispose()
    assert answer.value.code == 503
    assert answer.value.headers["Retry-After"] == "1"
    assert "database is unavailable" in answer.value.read().decode()
    assert all(acknowledged)
    stored = _stored_keys(db_url, "locked")
    assert dict(stored) == dict.fromkeys(ShippingJob.expected_steps(4, 60), 1)
    assert "Traceback" not in log, log[-3000:]
    assert log.count("database unavailable") == 1, log[-3000:]
