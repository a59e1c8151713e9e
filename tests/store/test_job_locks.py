"""One pass per job at a time: across threads (both engines) and across processes, and
handed over when the holder's database session dies (PostgreSQL)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from stepscope.store.engine import make_engine
from stepscope.store.job_locks import job_lock, lock_key
from tests.support import fresh_postgres_database


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_postgres_database() as url:
        yield url


def test_a_held_job_is_skipped_by_another_thread_and_free_once_released(db_url: str) -> None:
    engine = make_engine(db_url)
    seen: list[bool] = []

    def other(job_id: str) -> None:
        with job_lock(engine, job_id) as held:
            seen.append(held)

    try:
        with job_lock(engine, "a") as held:
            assert held
            for job_id in ("a", "b"):
                thread = threading.Thread(target=other, args=(job_id,))
                thread.start()
                thread.join()
        other("a")
    finally:
        engine.dispose()
    assert seen == [False, True, True]  # a: held; b: another job; a: released


def test_a_waiting_pass_gets_the_job_when_the_holder_finishes(db_url: str) -> None:
    engine = make_engine(db_url)
    release = threading.Event()
    holding = threading.Event()

    def holder() -> None:
        with job_lock(engine, "a") as held:
            assert held
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        holding.wait(10)
        threading.Timer(0.3, release.set).start()
        with job_lock(engine, "a", wait_s=10) as held:
            assert held
    finally:
        release.set()
        thread.join()
        engine.dispose()


def test_on_postgresql_another_process_skips_the_job_until_its_holder_dies(pg_url: str) -> None:
    replica_a, replica_b = make_engine(pg_url), make_engine(pg_url)  # two servers' pools
    try:
        with job_lock(replica_a, "job-1") as held_by_a:
            assert held_by_a
            with job_lock(replica_b, "job-1") as held_by_b:
                assert not held_by_b
            with job_lock(replica_b, "job-2") as other_job:
                assert other_job
            # Replica A "dies": its session ends without unlocking (as with SIGKILL).
            with replica_b.connect() as conn:
                key = lock_key("job-1")
                terminated = conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_locks "
                        "WHERE locktype = 'advisory' AND granted "
                        "AND classid = ((:key >> 32) & 4294967295)::oid "
                        "AND objid = (:key & 4294967295)::oid"
                    ),
                    {"key": key},
                ).all()
            assert terminated == [(True,)]
            with job_lock(replica_b, "job-1", wait_s=10) as taken_over:
                assert taken_over
    finally:
        replica_a.dispose()
        replica_b.dispose()
