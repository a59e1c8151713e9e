"""`stepscope demo`: a server on the embedded database with a synthetic straggler job in it."""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from stepscope.pipeline.job_pass import analyze_stored_job
from stepscope.server.app import create_app
from stepscope.server.settings import Settings
from stepscope.synthetic.generate import JobSpec, Straggler, generate
from stepscope.synthetic.stream import stream_job

log = logging.getLogger(__name__)


def _start_server(app: FastAPI, settings: Settings) -> tuple[uvicorn.Server, threading.Thread]:
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="stepscope-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(
                f"http://{settings.host}:{settings.port}/healthz", timeout=2
            ):
                return server, thread
        except OSError:
            if not thread.is_alive():
                raise RuntimeError(f"server on port {settings.port} did not start") from None
            time.sleep(0.1)
    raise TimeoutError("server did not become healthy")


def run_demo(
    *,
    database_url: str,
    port: int,
    num_ranks: int,
    num_steps: int,
    keep_serving: bool,
    print_findings: Callable[[list[Any]], None],
    say: Callable[[str], None],
) -> None:
    """Stream a job where one rank computes 25% slower from step 200 and another waits on data."""
    settings = Settings(database_url=database_url, port=port)
    app = create_app(settings)
    server, thread = _start_server(app, settings)
    url = f"http://{settings.host}:{port}"
    job_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    spec = JobSpec(
        job_id=job_id,
        num_ranks=num_ranks,
        num_steps=num_steps,
        start_ts=time.time() - num_steps * 0.5,
        stragglers=(
            Straggler(ranks=(min(5, num_ranks - 1),), factor=1.25, cause="compute", from_step=200),
            Straggler(
                ranks=(min(11, num_ranks - 1),),
                factor=1.15,
                cause="data",
                from_step=100,
                until_step=min(400, num_steps),
            ),
        ),
    )
    say(f"stepscope demo: server on {url} (database {database_url})")
    stats = stream_job(generate(spec), url, steps_per_batch=20)
    say(
        f"streamed job {job_id}: {num_ranks} ranks x {num_steps} steps, "
        f"{stats.rows} rows in {stats.batches} batches, {stats.elapsed_s:.1f} s"
    )
    print_findings(analyze_stored_job(app.state.engine, job_id))
    if not keep_serving:
        server.should_exit = True
        thread.join(timeout=10)
        return
    say(f"serving on {url} — Ctrl-C to stop")
    try:
        while thread.is_alive():
            thread.join(timeout=1)
    except KeyboardInterrupt:
        server.should_exit = True
        thread.join(timeout=10)
