"""The server's background analysis: an incremental pass over each active job, on a timer.

A pass that fails is retried at the next tick, then less and less often while it keeps
failing; it holds up neither the other jobs' passes nor ingest and the API. Each job's pass
runs in one place at a time (stepscope.store.job_locks): with several server replicas on one
PostgreSQL, the replica that takes a job's lock first runs its pass and the others skip it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from stepscope import query
from stepscope.pipeline.job_pass import FindingsHook, JobAnalyzer
from stepscope.pipeline.resources import PassResources
from stepscope.store import jobs
from stepscope.store.availability import OUTAGES, is_unavailable
from stepscope.store.job_locks import job_lock

log = logging.getLogger(__name__)

MAX_RETRY_INTERVALS = 16
"""A job whose pass keeps failing is retried at least every this many intervals."""


@dataclass(slots=True)
class _Failing:
    num_failures: int
    retry_at: float
    """time.monotonic() before which the job's pass is not tried again."""


@dataclass(slots=True)
class RoundResult:
    """What one round of passes did."""

    changed: list[str]
    """Jobs whose pass stored new rollups or findings."""
    failed: list[str]
    skipped: list[str]
    """Jobs whose pass ran elsewhere (another thread or replica) or waits for its retry."""


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
        self._failing: dict[str, _Failing] = {}
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
        return len(self.run_round().changed)

    def run_round(self) -> RoundResult:
        """One pass over each active job that is not failing-and-waiting or analysed elsewhere."""
        result = RoundResult(changed=[], failed=[], skipped=[])
        active = jobs.active_jobs(self._engine, seen_within_s=self._active_within_s)
        now = time.monotonic()
        for job_id in active:
            failing = self._failing.get(job_id)
            if failing is not None and now < failing.retry_at:
                result.skipped.append(job_id)
                continue
            start = time.perf_counter()
            try:
                with job_lock(self._engine, job_id) as held:
                    if not held:
                        result.skipped.append(job_id)
                        continue
                    changed = self._pass(job_id)
            except Exception as exc:
                self._told(time.perf_counter() - start, exc)
                result.failed.append(job_id)
                if is_unavailable(exc):  # every other job would fail alike: wait for the next tick
                    OUTAGES.unavailable(exc)
                    break
                self._failed(job_id, exc)
                continue
            self._told(time.perf_counter() - start, None)
            self._failing.pop(job_id, None)
            OUTAGES.available()
            if changed:
                result.changed.append(job_id)
                self._warm(job_id)
        return result

    def _pass(self, job_id: str) -> bool:
        """Run the job's pass; True when it stored new rollups or findings."""
        result = JobAnalyzer(
            self._engine,
            job_id,
            grace_s=self._grace_s,
            on_findings=self._on_findings,
            resources=self._resources,
        ).run()
        return bool(result.rolled_up_steps or result.findings)

    def _failed(self, job_id: str, exc: Exception) -> None:
        """Log the failure (a traceback the first time) and schedule the retry."""
        failing = self._failing.get(job_id) or _Failing(num_failures=0, retry_at=0.0)
        failing.num_failures += 1
        delay_intervals = min(2 ** (failing.num_failures - 1) - 1, MAX_RETRY_INTERVALS)
        failing.retry_at = time.monotonic() + delay_intervals * self._interval_s
        self._failing[job_id] = failing
        if failing.num_failures == 1:
            log.exception("analysis of job %s failed; retrying at the next pass", job_id)
        else:
            log.warning(
                "analysis of job %s failed again (%d times in a row): %s: %s",
                job_id,
                failing.num_failures,
                type(exc).__name__,
                exc,
            )

    def _told(self, duration_s: float, error: BaseException | None) -> None:
        if self._on_pass is not None:
            self._on_pass(duration_s, error)

    def _warm(self, job_id: str) -> None:
        """Compute the job's rank table now, off the request path: the dashboard and the API
        then answer from memory until the next pass (stepscope.query.memo)."""
        try:
            query.rank_table(self._engine, job_id)
        except Exception as exc:
            OUTAGES.failed(exc, log, "the rank table of job %s failed", job_id)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.run_round()
            except Exception as exc:  # the thread must outlive any round
                OUTAGES.failed(exc, log, "a round of background analysis failed")
