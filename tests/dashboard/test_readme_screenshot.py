"""The README's picture: a job page with a straggler (saved when STEPSCOPE_TEST_ARTIFACTS is set).

Regenerate docs/images/job-page.png with
`STEPSCOPE_TEST_ARTIFACTS=docs/images pytest tests/dashboard/test_readme_screenshot.py`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepscope.pipeline.job_pass import analyze_stored_job
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.synthetic.stream import batch_rounds
from tests.dashboard.conftest import send_rounds
from tests.dashboard.test_pages import SETTLED
from tests.jobs import STRAGGLER, straggler_job
from tests.live_server import RunningServer, run_server

pytestmark = pytest.mark.browser

JOB = "llm-1b-pretrain-0412"
NAME = "llm-1b pretrain"
VIEWPORT = {"width": 1280, "height": 800}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server holding one analysed 16-rank job whose rank STRAGGLER is slow in compute."""
    db_url = f"sqlite:///{tmp_path_factory.mktemp('readme') / 'stepscope.db'}"
    engine = make_engine(db_url)
    upgrade(engine)
    with run_server(db_url) as running:
        job = straggler_job(JOB, num_ranks=16, num_steps=600, straggler_from=250)
        job.job["name"] = NAME
        send_rounds(running.url, batch_rounds(job, steps_per_batch=50))
        analyze_stored_job(engine, JOB, grace_s=0.0)
        yield running
    engine.dispose()


def test_the_job_page_shows_the_straggler(browser: Any, server: RunningServer) -> None:
    context = browser.new_context(viewport=VIEWPORT)
    try:
        page = context.new_page()
        page.goto(f"{server.url}/jobs/{JOB}")
        page.wait_for_function(SETTLED, timeout=60_000)
        assert page.locator("h1").inner_text() == NAME
        findings = page.locator("#job-findings").inner_text()
        assert f"rank {STRAGGLER} on node-0001" in findings
        artifacts = os.environ.get("STEPSCOPE_TEST_ARTIFACTS")
        if artifacts:
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(Path(artifacts) / "job-page.png"))
    finally:
        context.close()
