"""Raw rows a job's next analyzer pass reads again, kept in memory between passes.

A live job's pass re-analyses its last step segment, so it reads that segment's rows (a
segment of a 1,024-rank job: ~260k step rows and as many collective rows) although only the
last few steps are new. The pass that read them keeps them here, tagged with the watermark it
stored; the next pass takes them only if the job's stored watermark is still that one (no
other pass, process or full re-analysis ran in between) and reads from the database only the
steps its new batches touched. Rows of steps no new batch touched cannot have changed: every
row arrives in a batch, and the watermark's overlap re-reads batches that committed late.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import polars as pl


@dataclass(frozen=True, slots=True)
class RecentRows:
    """Every stored step and collective row of steps first_step..last_step, as of watermark."""

    watermark: float
    first_step: int
    last_step: int
    steps: pl.DataFrame
    collectives: pl.DataFrame


class RecentRowsCache:
    """RecentRows per (database, job), the least recently used dropped beyond max_jobs."""

    def __init__(self, max_jobs: int = 16) -> None:
        self._max_jobs = max_jobs
        self._entries: OrderedDict[tuple[str, str], RecentRows] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, database: str, job_id: str, watermark: float) -> RecentRows | None:
        """The job's rows if they are current as of `watermark`; they leave the cache."""
        with self._lock:
            rows = self._entries.pop((database, job_id), None)
        return rows if rows is not None and rows.watermark == watermark else None

    def put(self, database: str, job_id: str, rows: RecentRows) -> None:
        with self._lock:
            self._entries[(database, job_id)] = rows
            self._entries.move_to_end((database, job_id))
            while len(self._entries) > self._max_jobs:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
