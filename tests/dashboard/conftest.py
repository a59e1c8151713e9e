"""A real server holding simulated jobs for the dashboard tests, and a headless Chromium.

The jobs go in over the wire protocol (stepscope.synthetic.stream) and are analysed in-process
with stepscope.pipeline.job_pass.analyze_stored_job on the server's database.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import sqlalchemy as sa

from stepscope.pipeline.job_pass import analyze_stored_job
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.synthetic.generate import JobSpec, SynthJob, generate
from stepscope.synthetic.stream import batch_rounds, post_bodies
from tests.jobs import step_rows, straggler_job
from tests.live_server import RunningServer, run_server
from tests.support import require

CHROMIUM = os.environ.get("STEPSCOPE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
MAIN = "dash-main"
LIVE = "dash-live"
HOSTILE_NAME = "<script>window.__pwned = 1</script> llm <b>8b</b>"
LIVE_ROUNDS_FIRST = 4
"""Rounds (of 50 steps) of the live job sent before its page opens."""


@dataclass(frozen=True, slots=True)
class Site:
    server: RunningServer
    engine: sa.Engine
    steps: pl.DataFrame
    """The main job's step rows as generated, float64, with compute_s."""
    live_rounds: list[list[bytes]]
    """The live job's batch rounds not sent yet."""


def main_job() -> SynthJob:
    job = straggler_job(MAIN)
    job.job["name"] = HOSTILE_NAME
    return job


def live_job() -> SynthJob:
    return generate(
        JobSpec(
            job_id=LIVE,
            num_ranks=4,
            ranks_per_node=4,
            num_steps=300,
            spike_prob=0.0,
            start_ts=time.time() - 150,
            seed=5,
        )
    )


def send_rounds(url: str, rounds: list[list[bytes]], token: str | None = None) -> None:
    """POST batch rounds to the collector; every batch must be accepted. (In a thread of its
    own: Playwright's sync API keeps an event loop running in this one.)"""
    with ThreadPoolExecutor(1) as pool:
        stats = pool.submit(
            asyncio.run, post_bodies(url, rounds, token=token, concurrency=16)
        ).result()
    assert not stats.failures, stats.failures


@pytest.fixture(scope="package")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """A server with the main job (finished, analysed) and the live job's first rounds."""
    db_url = f"sqlite:///{tmp_path_factory.mktemp('dashboard') / 'stepscope.db'}"
    engine = make_engine(db_url)
    upgrade(engine)
    with run_server(db_url) as server:
        job = main_job()
        send_rounds(server.url, batch_rounds(job, steps_per_batch=50))
        analyze_stored_job(engine, MAIN, grace_s=0.0)
        rounds = batch_rounds(live_job(), steps_per_batch=50)
        send_rounds(server.url, rounds[:LIVE_ROUNDS_FIRST])
        analyze_stored_job(engine, LIVE, grace_s=0.0)
        steps = step_rows(job)
        yield Site(
            server=server, engine=engine, steps=steps, live_rounds=rounds[LIVE_ROUNDS_FIRST:]
        )
    engine.dispose()


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    """Headless Chromium (Debian's); required under CI=true."""
    found = Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is not None
    require(found, f"Chromium at {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require(False, "playwright (pip install 'stepscope[dev]')")
        raise
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="package")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go ($STEPSCOPE_TEST_ARTIFACTS, else pytest's temporary folder)."""
    where = os.environ.get("STEPSCOPE_TEST_ARTIFACTS")
    path = Path(where) if where else tmp_path_factory.mktemp("artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path
