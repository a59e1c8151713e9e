"""One stored, analysed set of jobs per engine, shared by the query tests.

The main job goes through the real write path (wire batches, validation, the bulk writer)
and the real analyzer; the tests compare query results with polars computations over the
same raw rows (`Stored.steps` etc., the synthetic frames).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pytest
import sqlalchemy as sa

from stepscope.collector.validate import parse_batch
from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.store import tables
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.store.writer import BatchWriter
from stepscope.synthetic.generate import JobSpec, SynthJob, generate, to_frames
from stepscope.synthetic.stream import rank_batches
from tests.jobs import step_rows, straggler_job
from tests.support import fresh_postgres_database

JOB = "train-a"
NUM_RANKS = 16
NUM_STEPS = 1100
"""More than 1,024 steps: the analyzer's rank buckets are 2 steps wide."""
SPIKE = (9, 777)
"""(rank, step) whose step_s is made 3 s longer: a one-step spike of the max."""
START_TS = 1.7e9


@dataclass(frozen=True, slots=True)
class Stored:
    """A database holding the jobs, and the raw rows of the main job as polars frames."""

    engine: sa.Engine
    steps: pl.DataFrame
    """Steps with compute_s derived as the rollups do, as float64, with node."""
    collectives: pl.DataFrame
    gpu: pl.DataFrame
    job: dict[str, Any]
    job_ids: list[str]


EVENTS = [
    {"ts": START_TS + 30.5, "kind": "restart", "message": "rank 2 restarted"},
    {"ts": START_TS + 60.25, "kind": "xid", "message": None, "attributes": {"xid": 79, "gpu": 0}},
]
"""Events sent with rank 2's first batch of the main job."""


def write(engine: sa.Engine, job: SynthJob, *, steps_per_batch: int, running: bool = False) -> None:
    """Send every rank's wire batches through validation and the real writer."""
    writer = BatchWriter(engine)
    try:
        for rank in range(job.spec.num_ranks):
            for doc in rank_batches(job, rank, steps_per_batch=steps_per_batch):
                if running:
                    doc["job"].pop("status", None)
                    doc["job"].pop("ended_at", None)
                if job.spec.job_id == JOB and rank == 2 and doc["seq"] == 0:
                    doc["events"] = EVENTS
                batch = parse_batch(orjson.loads(orjson.dumps(doc)))
                writer.write(
                    job=batch.job, source=batch.source, seq=batch.seq, sections=batch.sections
                )
    finally:
        writer.close()


def main_job() -> SynthJob:
    job = straggler_job(
        JOB, num_ranks=NUM_RANKS, num_steps=NUM_STEPS, straggler_from=300, start_ts=START_TS, seed=7
    )
    job.job["name"] = "Train A"
    job.job["benchmark_key"] = "bench/x"
    rank, step = SPIKE
    job.steps["step_s"][rank * NUM_STEPS + step] += 3.0
    return job


SMALL_JOBS: list[dict[str, Any]] = [
    # job_id, name, benchmark key, start offset (s), clean step time, analysed, running, ranks
    {"job_id": "j-b", "name": "train_b%", "key": "bench/x", "at": 100, "step_s": 0.3,
     "analysed": True, "running": False, "ranks": 2},
    {"job_id": "j-c", "name": "TRAIN c", "key": "bench/y", "at": 200, "step_s": 0.7,
     "analysed": True, "running": True, "ranks": 2},
    {"job_id": "j-d", "name": "eval d", "key": "bench/y", "at": 300, "step_s": 0.4,
     "analysed": False, "running": True, "ranks": 4},
    {"job_id": "j-e", "name": "eval_e", "key": "bench/y", "at": 300, "step_s": 0.4,
     "analysed": False, "running": True, "ranks": 4},
    {"job_id": "j-f", "name": None, "key": "bench/z", "at": 400, "step_s": 0.5,
     "analysed": False, "running": False, "ranks": 4},
    {"job_id": "j-g", "name": "x%y", "key": "bench/z", "at": 500, "step_s": 0.2,
     "analysed": True, "running": False, "ranks": 2},
]  # fmt: skip
STALE_JOB = "j-e"


def _store_all(engine: sa.Engine) -> Stored:
    job = main_job()
    write(engine, job, steps_per_batch=100)
    JobAnalyzer(engine, JOB, grace_s=0).run()
    for small in SMALL_JOBS:
        spec = JobSpec(
            job_id=small["job_id"],
            num_ranks=small["ranks"],
            num_steps=40,
            base_step_s=small["step_s"],
            start_ts=START_TS + small["at"],
            spike_prob=0.0,
            seed=1,
        )
        tiny = generate(spec)
        tiny.job["name"], tiny.job["benchmark_key"] = small["name"], small["key"]
        write(engine, tiny, steps_per_batch=40, running=small["running"])
        if small["analysed"]:
            JobAnalyzer(engine, small["job_id"], grace_s=0).run()
    with engine.begin() as conn:  # the stale job's ranks last sent a batch long ago
        r = tables.ranks
        conn.execute(sa.update(r).where(r.c.job_id == STALE_JOB).values(last_seen=START_TS))
    frames = to_frames(job)
    steps = step_rows(job)
    gpu = frames["gpu"]
    return Stored(
        engine=engine,
        steps=steps,
        collectives=frames["collectives"].with_columns(pl.col("busy_s").cast(pl.Float64)),
        gpu=gpu.with_columns(
            pl.col(c).cast(pl.Float64) for c, t in gpu.schema.items() if t.is_float()
        ),
        job=job.job,
        job_ids=[JOB, *(s["job_id"] for s in SMALL_JOBS)],
    )


@pytest.fixture(scope="package", params=["sqlite", "postgresql"])
def stored(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stored]:
    """The jobs of this module stored and analysed in a fresh database of each engine."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            path: Path = tmp_path_factory.mktemp("query") / "stepscope.db"
            url = f"sqlite:///{path}"
        else:
            url = stack.enter_context(fresh_postgres_database())
        engine = make_engine(url)
        stack.callback(engine.dispose)
        upgrade(engine)
        yield _store_all(engine)
