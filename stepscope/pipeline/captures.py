"""Deep captures (#21): who asks which ranks to record torch.profiler, and when they are told.

Requests come from the API and from findings (a straggler or a hang on a live job). Each
names a culprit rank and a reference rank; the desk keeps the captures not yet told to their
rank in memory, so that the ingest route answers a rank's batch with its capture without a
database read per batch. The memory is re-read from the database every `refresh_s` (other
replicas' requests), and a capture is claimed in the database before it is told, so that
replicas behind one load balancer tell each capture once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import sqlalchemy as sa

from stepscope import schema
from stepscope.query import JobNotFound
from stepscope.store import captures
from stepscope.store.availability import OUTAGES

log = logging.getLogger(__name__)

AUTO_KINDS = frozenset({"straggler_rank", "straggler_node", "hang"})
"""Finding kinds that ask for a capture of their first rank on a live job."""


class BadCaptureRequest(ValueError):
    """A request naming a rank or a number of steps that cannot be; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class CaptureDesk:
    """Takes capture requests and hands each to its rank in the answer to its next batch."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        num_steps: int,
        max_steps: int,
        auto: bool,
        max_auto_per_job: int,
        refresh_s: float = 1.0,
    ) -> None:
        if not 1 <= num_steps <= max_steps:
            raise ValueError(
                f"capture_steps ({num_steps}) must be 1 to capture_request_max_steps ({max_steps})"
            )
        self._engine = engine
        self.num_steps = num_steps
        self.max_steps = max_steps
        self.auto = auto
        self.max_auto_per_job = max_auto_per_job
        self._lock = threading.Lock()
        self._waiting: dict[tuple[str, int], deque[captures.Pending]] = {}
        self._refresh_s = refresh_s
        self._refreshed_at = -float("inf")

    def refresh_due(self) -> bool:
        """The memory is older than refresh_s. Only the first caller to ask hears so: the
        requests that arrive while it re-reads do not each read again."""
        now = time.monotonic()
        with self._lock:
            if now - self._refreshed_at < self._refresh_s:
                return False
            self._refreshed_at = now
            return True

    def refresh(self) -> None:
        """Re-read the captures stored but not yet told (this replica's, other replicas',
        those of before a restart); on a database error, keep the memory until next time."""
        self._refreshed_at = time.monotonic()
        try:
            with self._engine.connect() as conn:
                stored = captures.pending_captures(conn)
        except Exception as exc:
            log.warning("could not read pending captures: %s", exc)
            return
        waiting: dict[tuple[str, int], deque[captures.Pending]] = {}
        for pending in stored:
            waiting.setdefault((pending.job_id, pending.rank), deque()).append(pending)
        with self._lock:
            self._waiting = waiting

    def hold(self, pending: captures.Pending) -> None:
        """Keep the capture until its rank's next batch."""
        with self._lock:
            self._waiting.setdefault((pending.job_id, pending.rank), deque()).append(pending)

    def take(self, job_id: str, rank: int) -> captures.Pending | None:
        """The rank's oldest capture not yet told, removed from the desk; None (cheap) if none."""
        if not self._waiting:
            return None
        with self._lock:
            queue = self._waiting.get((job_id, rank))
            if not queue:
                return None
            pending = queue.popleft()
            if not queue:
                del self._waiting[(job_id, rank)]
        return pending

    def claim(self, pending: captures.Pending) -> bool:
        """Store that the rank is told now; False when another replica told it already."""
        with self._engine.begin() as conn:
            return captures.mark_delivered(conn, pending.capture_id, time.time())

    def request(
        self,
        job_id: str,
        *,
        rank: int,
        reference_rank: int | None = None,
        num_steps: int | None = None,
        reason: str = "user",
        requested_by: str = "api",
        finding: dict[str, Any] | None = None,
    ) -> int:
        """Store a capture of `rank` and a reference rank (the lowest other rank that reported,
        unless named) and hold both for their next batch; the request id.

        Raises JobNotFound for an unknown job, BadCaptureRequest naming `rank`,
        `reference_rank` or `num_steps` when one is wrong.
        """
        num_steps = self.num_steps if num_steps is None else num_steps
        if not 1 <= num_steps <= self.max_steps:
            raise BadCaptureRequest(
                "num_steps", f"num_steps must be 1 to {self.max_steps}; got {num_steps}"
            )
        with self._engine.begin() as conn:
            known = captures.reported_ranks(conn, job_id)
            if not known:
                raise JobNotFound(job_id)
            if rank not in known:
                raise BadCaptureRequest("rank", f"rank {rank} has sent no batch for job {job_id!r}")
            if reference_rank is None:
                others = [r for r in known if r != rank]
                reference_rank = others[0] if others else None
            elif reference_rank == rank or reference_rank not in known:
                raise BadCaptureRequest(
                    "reference_rank",
                    f"reference_rank {reference_rank} must be another rank that sent a batch",
                )
            ranks: list[tuple[int, schema.CaptureRole]] = [(rank, "culprit")]
            if reference_rank is not None:
                ranks.append((reference_rank, "reference"))
            request_id, pending = captures.create_request(
                conn,
                job_id=job_id,
                ranks=ranks,
                num_steps=num_steps,
                reason=reason,
                requested_by=requested_by,
                requested_at=time.time(),
                finding=finding,
            )
        for one in pending:
            self.hold(one)
        return request_id

    def on_findings(self, job_id: str, findings: list[schema.Finding]) -> None:
        """The findings hook: a capture of each new straggler's or hang's first rank while the
        job runs, at most max_auto_per_job per job and one per rank; never raises."""
        if not self.auto:
            return
        try:
            self._capture_findings(job_id, findings)
        except Exception as exc:
            OUTAGES.failed(exc, log, "asking for a deep capture of job %s failed", job_id)

    def _capture_findings(self, job_id: str, findings: list[schema.Finding]) -> None:
        wanted = [f for f in findings if f.kind in AUTO_KINDS and f.ranks]
        if not wanted:
            return
        with self._engine.connect() as conn:
            if captures.job_ended(conn, job_id):
                return
            done = captures.captured_ranks(conn, job_id, "analysis")
        for finding in wanted:
            rank = int(finding.ranks[0])
            if rank in done or len(done) >= self.max_auto_per_job:
                continue
            done.add(rank)
            self.request(
                job_id,
                rank=rank,
                reason=finding.kind,
                requested_by="analysis",
                finding=finding.to_dict(),
            )
            log.info("asked job %s rank %d for a deep capture (%s)", job_id, rank, finding.kind)
