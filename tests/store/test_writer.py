"""Group commit of the batch writer, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

from stepscope.store.engine import make_engine
from stepscope.store.writer import BatchWriter, _Pending
from tests.live_server import read_rows


def pending(rank: int, seq: int, *, status: str | None = None, step: int = 0) -> _Pending:
    steps = {
        "job_id": ["j"],
        "rank": [rank],
        "step": [step],
        "ts": [100.0 + step],
        "step_s": [0.5],
        "data_s": [0.0],
    }
    job: dict[str, Any] = {"job_id": "j", "world_size": 2, "status": status}
    source = {"rank": rank, "incarnation": "i", "node": f"host-{rank}"}
    return _Pending(job=job, source=source, seq=seq, sections={"steps": steps})


def test_one_group_stores_each_batch_once_and_merges_job_fields(db_url: str) -> None:
    engine = make_engine(db_url)
    writer = BatchWriter(engine)
    try:
        # The writer thread forms groups from whatever is queued; drive one group directly.
        group = [
            pending(0, 0),
            pending(0, 0),
            pending(1, 0),
            pending(0, 1, status="finished", step=1),
        ]
        results = writer._write_group(group)
        assert [r.duplicate for r in results] == [False, True, False, False]
        assert [r.accepted["steps"] for r in results] == [1, 1, 1, 1]
        again = writer.write(
            job=group[2].job, source=group[2].source, seq=0, sections=group[2].sections
        )
        assert again.duplicate
    finally:
        writer.close()
        engine.dispose()
    assert len(read_rows(db_url, "steps", "j")) == 3
    assert len(read_rows(db_url, "ingest_batches", "j")) == 3
    (job,) = read_rows(db_url, "jobs", "j")
    assert (job["status"], job["started_at"], job["world_size"]) == ("finished", 100.0, 2)
    assert sorted((r["rank"], r["node"]) for r in read_rows(db_url, "ranks", "j")) == [
        (0, "host-0"),
        (1, "host-1"),
    ]


def test_a_peers_last_batch_after_rank_0s_final_status_keeps_it_but_a_restart_reopens_it(
    db_url: str,
) -> None:
    engine = make_engine(db_url)
    writer = BatchWriter(engine)

    def write(batch: _Pending) -> None:
        writer.write(job=batch.job, source=batch.source, seq=batch.seq, sections=batch.sections)

    def status() -> str:
        (job,) = read_rows(db_url, "jobs", "j")
        return str(job["status"])

    try:
        write(pending(0, 0))
        assert status() == "running"
        write(pending(0, 1, status="failed", step=1))
        write(pending(1, 0, step=1))  # rank 1's last records, after rank 0 closed
        assert status() == "failed"
        restarted = pending(1, 0, step=2)
        restarted.source = {**restarted.source, "incarnation": "i2"}
        restarted.sections["events"] = {
            "job_id": ["j"],
            "rank": [1],
            "ts": [101.0],
            "kind": ["start"],
            "message": ["process started (restart 1)"],
            "attributes": ['{"incarnation": "i2", "restart_count": 1}'],
        }
        write(restarted)
        assert status() == "running"
        write(pending(0, 2, status="finished", step=3))
        write(pending(1, 1, step=3))
        assert status() == "finished"
    finally:
        writer.close()
        engine.dispose()
