"""The server's background analysis: an incremental pass over each active job, on a timer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa

from stepscope import query
from stepscope.pipeline.job_pass import FindingsHook, JobAnalyzer
from stepscope.pipeline.resources import PassResources
from stepscope.store import jobs

log = logging.getLogger(__name__)

PassHook = Callable[[float, BaseException | None], None]
"""Told each job pass's duration in seconds and its error (None when it succeeded)."""


class BackgroundAnalyzer:
    """A daemon thread that runs an incremental pass over active jobs every `interval_s`."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        interval_s: float,
        active_within_s: float,
        grace_s: float = 30.0,
        resources: PassResources,
        on_findings: FindingsHook | None = None,
        on_pass: PassHook | None = None,
    ) -> None:
        self._engine = engine
        self._on_pass = on_pass
        self._interval_s = interval_s
        self._active_within_s = active_within_s
        self._grace_s = grace_s
        self._on_findings = on_findings
        self._resources = resources
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._interval_s <= 0:
            return
        self._thread = threading.Thread(target=self._run, name="stepscope-analyzer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def run_once(self) -> int:
        """One pass over each active job; how many had new data."""
        active = jobs.active_jobs(self._engine, seen_within_s=self._active_within_s)
        changed = 0
        for job_id in active:
            start = time.perf_counter()
            try:
                result = JobAnalyzer(
                    self._engine,
                    job_id,
                    grace_s=self._grace_s,
                    on_findings=self._on_findings,
                    resources=self._resources,
                ).run()
            except Exception as exc:
                log.exception("analysis of job %s failed", job_id)
                self._told(time.perf_counter() - start, exc)
                continue
            self._told(time.perf_counter() - start, None)
            if result.rolled_up_steps or result.findings:
                changed += 1
                self._warm(job_id)
        return changed

    def _told(self, duration_s: float, error: BaseException | None) -> None:
        if self._on_pass is not None:
            self._on_pass(duration_s, error)

    def _warm(self, job_id: str) -> None:
        """Compute the job's rank table now, off the request path: the dashboard and the API
        then answer from memory until the next pass (stepscope.query.memo)."""
        try:
            query.rank_table(self._engine, job_id)
        except Exception:
            log.exception("the rank table of job %s failed", job_id)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.run_once()
