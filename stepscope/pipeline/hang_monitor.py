"""Hang reports as they arrive (#19): store each rank's latest, attribute the job's hang at
once (debounced per job), keep one open hang finding per job and close it on progress."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa

from stepscope import schema
from stepscope.analysis.hangs.culprits import HangState, RankReport, attribute_hang, resumed
from stepscope.store import hang_reports
from stepscope.store.availability import OUTAGES

log = logging.getLogger(__name__)

FindingsHook = Callable[[str, list[schema.Finding]], None]
_IDENTITY = ("kind", "ranks", "node", "first_step", "metric", "severity")


@dataclass(frozen=True, slots=True)
class HangView:
    """A job's hang now: the open finding (or None) and what its latest reports say."""

    finding: schema.Finding | None
    finding_id: int | None
    state: HangState
    num_reports: int


def _attribute(
    job_id: str,
    reports: list[RankReport],
    silent_after_s: float,
    ended: hang_reports.HangEnd | None,
) -> HangState:
    """The job's hang state, without the reports that belong to its last closed hang."""
    return attribute_hang(
        job_id,
        reports,
        silent_after_s=silent_after_s,
        ignore_hangs_before_ts=ended.clock_ts if ended else None,
        ignore_stalls_before_ts=ended.resumed_ts if ended else None,
    )


def current_hang(engine: sa.Engine, job_id: str, *, silent_after_s: float) -> HangView | None:
    """The job's hang state; None when the job sent no hang report or heartbeat."""
    with engine.connect() as conn:
        rows = hang_reports.load_reports(conn, job_id)
        stored = hang_reports.open_hang(conn, job_id)
        ended = hang_reports.last_hang_end(conn, job_id)
    if not rows and stored is None:
        return None
    state = _attribute(job_id, [RankReport.of(row) for row in rows], silent_after_s, ended)
    return HangView(
        finding=stored.finding if stored else None,
        finding_id=stored.id if stored else None,
        state=state,
        num_reports=len(rows),
    )


class HangMonitor:
    """A thread that writes hang reports in groups and attributes each job's hang at most
    once per `debounce_s` while its reports arrive."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        silent_after_s: float = 6.0,
        debounce_s: float = 0.2,
        on_findings: FindingsHook | None = None,
    ) -> None:
        self._engine = engine
        self._silent_after_s = silent_after_s
        self._debounce_s = debounce_s
        self._on_findings = on_findings
        self._queue: queue.Queue[tuple[list[dict[str, Any]], Future[None]] | None] = queue.Queue()
        self._dirty: dict[str, float] = {}
        """Job → when its next attribution is due (monotonic)."""
        self._last_run: dict[str, float] = {}
        self._ended: dict[str, hang_reports.HangEnd | None] = {}
        """Job → how its last closed hang ended."""
        self._open: dict[str, hang_reports.StoredHang | None] = {}
        """Job → its open hang finding (this thread alone writes hang findings)."""
        self._reports: dict[str, dict[int, RankReport]] = {}
        """Job → rank → latest report, parsed (kept by this thread, which alone writes them)."""
        self.attributed_at: dict[str, float] = {}
        """Job → wall time its latest attribution committed."""
        self._thread = threading.Thread(target=self._run, name="stepscope-hangs", daemon=True)
        self._thread.start()

    def submit(self, rows: list[dict[str, Any]]) -> Future[None]:
        """Queue validated reports (their hang_reports columns); done once they are stored,
        all in one transaction."""
        future: Future[None] = Future()
        self._queue.put((rows, future))
        return future

    def close(self, timeout_s: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            wait_s = None
            if self._dirty:
                wait_s = max(0.0, min(self._dirty.values()) - time.monotonic())
            try:
                item = self._queue.get(timeout=wait_s)
            except queue.Empty:
                item = ()  # type: ignore[assignment]
            if item is None:
                return
            group = [item] if item else []
            while sum(len(rows) for rows, _ in group) < 20_000:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._store(group)
                    return
                group.append(more)
            if group:
                self._store(group)
            self._attribute_due()

    def _store(self, group: list[tuple[list[dict[str, Any]], Future[None]]]) -> None:
        rows = [row for submitted, _ in group for row in submitted]
        try:
            with self._engine.begin() as conn:
                hang_reports.upsert_reports(conn, rows)
        except Exception as exc:
            # Unavailable: the request answers 503; the rank reports again.
            OUTAGES.failed(exc, log, "storing %d hang report(s) failed", len(rows))
            for _, future in group:
                future.set_exception(exc)
            return
        # The jobs are due before any answer: a client holding its answer sees the attribution
        # pending until one has seen its report.
        now = time.monotonic()
        for job_id in dict.fromkeys(row["job_id"] for row in rows):
            if job_id not in self._dirty:
                self._dirty[job_id] = max(now, self._last_run.get(job_id, 0.0) + self._debounce_s)
        try:
            self._cache(rows)
        except Exception:
            log.exception("caching %d hang report(s) failed; reloading them", len(rows))
            for row in rows:
                self._reports.pop(row["job_id"], None)
        for _, future in group:
            future.set_result(None)

    def _cache(self, rows: list[dict[str, Any]]) -> None:
        """Keep each rank's latest report of the jobs whose reports are cached."""
        for row in rows:
            cached = self._reports.get(row["job_id"])
            if cached is not None:
                known = cached.get(row["rank"])
                if known is None or known.ts <= row["ts"]:
                    cached[row["rank"]] = RankReport.of(row)

    def pending(self, job_id: str) -> bool:
        """Reports of the job are stored that no attribution has seen yet."""
        return job_id in self._dirty

    def _attribute_due(self) -> None:
        now = time.monotonic()
        for job_id, due in list(self._dirty.items()):
            if due > now:
                continue
            self._last_run[job_id] = time.monotonic()
            try:
                self.attribute(job_id)
            except Exception as exc:
                OUTAGES.failed(exc, log, "hang attribution of job %s failed", job_id)
            finally:
                del self._dirty[job_id]  # pending while it ran (stores wait for this thread)

    def attribute(self, job_id: str) -> schema.Finding | None:
        """Attribute the job's hang from its stored reports, in one transaction; the open
        hang finding after it (None when there is none)."""
        offered: schema.Finding | None = None
        with self._engine.begin() as conn:
            if job_id not in self._ended:
                self._ended[job_id] = hang_reports.last_hang_end(conn, job_id)
            if job_id not in self._reports:
                rows = hang_reports.load_reports(conn, job_id)
                self._reports[job_id] = {row["rank"]: RankReport.of(row) for row in rows}
            reports = list(self._reports[job_id].values())
            state = _attribute(job_id, reports, self._silent_after_s, self._ended[job_id])
            if job_id not in self._open:
                self._open[job_id] = hang_reports.open_hang(conn, job_id)
            stored = self._open[job_id]
            result: schema.Finding | None
            after: hang_reports.StoredHang | None = None
            if stored is not None:
                result, offered = self._follow(conn, stored, reports, state)
                after = None if result is None else hang_reports.StoredHang(stored.id, result)
            elif state.finding is not None:
                result = offered = self._opened(state.finding)
                after = hang_reports.StoredHang(hang_reports.save_hang(conn, result, None), result)
            else:
                result = None
        self._open[job_id] = after
        self.attributed_at[job_id] = time.time()
        if offered is not None and self._on_findings is not None:
            try:
                self._on_findings(job_id, [offered])
            except Exception:
                log.exception("offering the hang of job %s to webhooks failed", job_id)
        return result

    def _opened(self, finding: schema.Finding) -> schema.Finding:
        # The job's clock when the hang was named: heartbeats after it can close it.
        evidence = {
            **finding.evidence,
            "opened_ts": finding.evidence["since_ts"] + (finding.observed or 0.0),
        }
        return replace(finding, evidence=evidence, detected_at=time.time())

    def _follow(
        self,
        conn: sa.Connection,
        stored: hang_reports.StoredHang,
        reports: list[RankReport],
        state: HangState,
    ) -> tuple[schema.Finding | None, schema.Finding | None]:
        """Close the open hang when progress resumed, else bring it up to date."""
        old = stored.finding
        opened_ts = old.evidence.get("opened_ts", old.evidence.get("since_ts", 0.0))
        back = [r for r in reports if resumed(r, first_step=old.first_step, opened_ts=opened_ts)]
        if back or not state.hanging:
            progress = [r.last_progress_ts or r.ts for r in back] or [
                r.last_progress_ts or r.ts
                for r in reports
                if r.kind == "heartbeat" and r.ts > opened_ts
            ]
            clock_ts = max(r.ts for r in reports)
            resumed_ts = min(progress) if progress else clock_ts
            since = old.evidence["since_ts"]
            steps = [r.step for r in back if r.step is not None]
            closed = replace(
                old,
                last_step=max(steps) if steps else old.first_step,
                evidence={
                    **old.evidence,
                    "closed_at": time.time(),
                    "resumed_ts": resumed_ts,
                    "time_lost_s": max(0.0, resumed_ts - since),
                    "closed_clock_ts": clock_ts,
                },
            )
            hang_reports.save_hang(conn, closed, stored.id)
            # Hang reports made before this moment (the job's clock), or of a stall that
            # began before progress resumed, belong to this hang: one stall, one finding.
            self._ended[old.job_id] = hang_reports.HangEnd(clock_ts, resumed_ts)
            return None, None
        if state.finding is None:
            return old, None
        new = state.finding
        if _culprit_rejoined(old, new):
            return old, None
        kept: dict[str, Any] = {}
        if new.evidence.get("culprit_stack") is None and new.ranks == old.ranks:
            # A rank that died or stopped reporting sends no stack: keep the last one known.
            kept = {k: old.evidence.get(k) for k in ("culprit_stack", "stack_source")}
        updated = replace(
            new,
            detected_at=old.detected_at,
            evidence={
                **new.evidence,
                **kept,
                "opened_ts": opened_ts,
                "detection_s": old.evidence.get("detection_s"),
            },
        )
        hang_reports.save_hang(conn, updated, stored.id)
        changed = any(getattr(old, k) != getattr(updated, k) for k in _IDENTITY)
        return updated, updated if changed else None


def _culprit_rejoined(old: schema.Finding, new: schema.Finding) -> bool:
    """Whether the named culprit is back, so the hang is ending and keeps its name until
    progress closes it.

    A frozen rank that thaws first reports the stall it lived through (it was silent; it
    does not become "never entered"), and a late rank that enters the collective makes
    every member look stuck in it for a moment ("not completing"). A refinement while
    reports catch up (a late rank turns out to call another op: "mismatched") still
    updates the finding.
    """
    old_class, new_class = old.evidence.get("class"), new.evidence.get("class")
    if old_class == "silent" and new.ranks == old.ranks:
        return True
    return new_class == "not_completing" and old_class != "not_completing"
