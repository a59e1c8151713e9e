"""`stepscope db prune`: old jobs lose their raw rows (or everything), recent ones nothing."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import sqlalchemy as sa

from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.store import captures, tables
from stepscope.store.engine import make_engine
from stepscope.synthetic.generate import JobSpec, Straggler, generate
from tests.support import write_job_in_rounds


def _store(engine: Any, job_id: str, start_ts: float) -> None:
    spec = JobSpec(
        job_id=job_id,
        num_ranks=4,
        num_steps=200,
        start_ts=start_ts,
        stragglers=(Straggler(ranks=(1,), factor=1.3, cause="compute", from_step=80),),
        seed=8,
    )
    for _ in write_job_in_rounds(engine, generate(spec), steps_per_batch=100):
        pass
    JobAnalyzer(engine, job_id, grace_s=0.0).run()
    with engine.begin() as conn:  # a deep capture with its trace (#21): raw, like the steps
        _, [pending] = captures.create_request(
            conn,
            job_id=job_id,
            ranks=[(1, "culprit")],
            num_steps=3,
            reason="user",
            requested_by="api",
            requested_at=start_ts,
        )
        captures.save_trace(
            conn,
            pending.capture_id,
            trace_gz=b"\x1f\x8b trace",
            summary={"operators": []},
            first_step=5,
            last_step=7,
            at=start_ts,
        )


def _counts(engine: Any, job_id: str) -> dict[str, int]:
    names = ("steps", "collectives", "gpu_samples", "ingest_batches", "step_rollups")
    names += ("rank_buckets", "findings", "job_summaries", "jobs", "captures", "capture_requests")
    with engine.connect() as conn:
        return {
            name: conn.execute(
                sa.select(sa.func.count()).select_from(t).where(t.c.job_id == job_id)
            ).scalar_one()
            for name in names
            for t in [tables.Base.metadata.tables[name]]
        }


def _prune(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "db", "prune", "--db", db_url, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_prune_keep_rollups_deletes_raw_rows_of_old_jobs_only(db_url: str) -> None:
    engine = make_engine(db_url)
    _store(engine, "old", start_ts=time.time() - 40 * 86400)
    _store(engine, "new", start_ts=time.time() - 3600)
    # The ranks' last batch is when the test wrote it: make the old job silent for 40 days.
    with engine.begin() as conn:
        conn.execute(
            sa.update(tables.ranks)
            .where(tables.ranks.c.job_id == "old")
            .values(last_seen=time.time() - 40 * 86400)
        )
    before_new = _counts(engine, "new")
    before_old = _counts(engine, "old")

    done = _prune(db_url, "--older-than", "30d", "--keep-rollups")

    assert done.returncode == 0, done.stderr
    assert "1 job(s)" in done.stderr
    after_old = _counts(engine, "old")
    for raw in ("steps", "collectives", "gpu_samples", "ingest_batches", "captures"):
        assert before_old[raw] > 0
        assert after_old[raw] == 0, raw
    for kept in ("step_rollups", "rank_buckets", "findings", "job_summaries", "jobs"):
        assert after_old[kept] == before_old[kept] > 0, kept
    assert _counts(engine, "new") == before_new
    refused = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "analyze", "old", "--full", "--db", db_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2
    assert "pruned" in refused.stderr
    assert "Traceback" not in refused.stderr

    done = _prune(db_url, "--older-than", "30d")
    assert done.returncode == 0, done.stderr
    assert set(_counts(engine, "old").values()) == {0}
    assert _counts(engine, "new") == before_new
    engine.dispose()


def test_prune_rejects_a_bad_duration(db_url: str) -> None:
    done = _prune(db_url, "--older-than", "thirty days")
    assert done.returncode == 2
    assert "bad duration" in done.stderr
