"""Analysis of stored jobs: on demand and periodically for active jobs."""

from __future__ import annotations

import logging
import threading

import sqlalchemy as sa

from stepscope import schema
from stepscope.store import queries

log = logging.getLogger(__name__)


def analyze_stored_job(engine: sa.Engine, job_id: str) -> list[schema.Finding]:
    """Run the analysis on a stored job and make its findings the stored ones."""
    from stepscope.analysis import analyze

    frames = queries.load_job_frames(engine, job_id)
    findings = analyze(
        frames["steps"],
        collectives=frames["collectives"],
        gpu=frames["gpu"],
        ranks=frames["ranks"],
        job=queries.load_job(engine, job_id),
    )
    queries.replace_findings(engine, job_id, findings)
    return queries.load_findings(engine, job_id)


class BackgroundAnalyzer:
    """A daemon thread that re-analyses active jobs every `interval_s` seconds."""

    def __init__(self, engine: sa.Engine, *, interval_s: float, active_within_s: float) -> None:
        self._engine = engine
        self._interval_s = interval_s
        self._active_within_s = active_within_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._analyzed_at: dict[str, float] = {}
        """Job → arrival time of the newest batch its stored findings account for."""

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
        """Analyse each active job that received data since its last analysis; how many."""
        active = queries.active_jobs(self._engine, seen_within_s=self._active_within_s)
        stale = {j: t for j, t in active.items() if t > self._analyzed_at.get(j, -1.0)}
        for job_id, last_seen in stale.items():
            try:
                analyze_stored_job(self._engine, job_id)
            except Exception:
                log.exception("analysis of job %s failed", job_id)
            self._analyzed_at[job_id] = last_seen
        for job_id in set(self._analyzed_at) - set(active):
            del self._analyzed_at[job_id]
        return len(stale)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.run_once()
