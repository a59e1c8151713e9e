"""A real server per engine holding two streamed jobs, one with a known straggler.

The jobs go in through the wire protocol (`stepscope.synthetic.stream.stream_job` over HTTP) and
are analysed through `POST /api/v1/jobs/{job}/analyze`; tests compare what the API answers
with polars computations over the generated rows (`Api.steps`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import polars as pl
import pytest
import sqlalchemy as sa

from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.synthetic.generate import JobSpec, SynthJob, generate
from stepscope.synthetic.stream import stream_job
from tests.jobs import NUM_RANKS, RANKS_PER_NODE, step_rows, straggler_job
from tests.live_server import RunningServer, run_server
from tests.support import fresh_postgres_database

JOB = "api-main"
OTHER = "api-other"


@dataclass(frozen=True, slots=True)
class Api:
    """A running server with the jobs stored and analysed, and the generated rows."""

    server: RunningServer
    client: httpx.Client
    """Base URL {server}/api/v1."""
    engine: sa.Engine
    job: SynthJob
    steps: pl.DataFrame
    """The main job's step rows as generated, float64, with compute_s derived."""


def main_job() -> SynthJob:
    return straggler_job(JOB)


def other_job() -> SynthJob:
    """A job of the same benchmark without a straggler, 10% faster."""
    job = generate(
        JobSpec(
            job_id=OTHER,
            num_ranks=NUM_RANKS,
            ranks_per_node=RANKS_PER_NODE,
            num_steps=200,
            base_step_s=0.45,
            spike_prob=0.0,
            start_ts=time.time() - 300,
            seed=4,
        )
    )
    return job


def store_through_the_api(server: RunningServer, jobs: list[SynthJob]) -> None:
    """Stream the jobs over HTTP and analyse them through the API."""
    for job in jobs:
        stats = stream_job(job, server.url, steps_per_batch=50)
        assert not stats.failures, stats.failures
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for job in jobs:
            response = client.post(f"/api/v1/jobs/{job.spec.job_id}/analyze")
            assert response.status_code == 200, response.text


@pytest.fixture(scope="package", params=["sqlite", "postgresql"])
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """The server of each engine with both jobs stored and analysed."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            path: Path = tmp_path_factory.mktemp("api") / "stepscope.db"
            url = f"sqlite:///{path}"
        else:
            url = stack.enter_context(fresh_postgres_database())
        engine = make_engine(url)
        stack.callback(engine.dispose)
        upgrade(engine)
        server = stack.enter_context(run_server(url))
        job = main_job()
        store_through_the_api(server, [job, other_job()])
        client = stack.enter_context(httpx.Client(base_url=f"{server.url}/api/v1", timeout=60))
        steps = step_rows(job)
        yield Api(server=server, client=client, engine=engine, job=job, steps=steps)
