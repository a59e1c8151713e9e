"""Webhook notifications of warning and critical findings (DESIGN §6).

The analyzer offers each pass's warning/critical findings (a non-blocking put on a queue);
a sender thread stores one outbox row per (finding, URL) that is not stored yet
(stepscope.store.deliveries) and POSTs the due rows: a Slack-compatible JSON body (`text`,
one readable line) with the finding as structured fields, optionally signed with
HMAC-SHA256. Failures are retried with exponential backoff; a delivered row is kept, so
re-analysis and restarts do not resend it. A finding is identified by its kind, ranks,
node, first step, metric and severity: an escalation to critical is notified again.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import orjson
import sqlalchemy as sa

from stepscope import __version__
from stepscope.schema import Finding
from stepscope.store import deliveries
from stepscope.store.availability import OUTAGES
from stepscope.store.deliveries import Delivery
from stepscope.text.findings import finding_line

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Stepscope-Signature-256"
"""sha256=<hex HMAC-SHA256 of the raw body with STEPSCOPE_WEBHOOK_SECRET>."""
DELIVERY_HEADER = "X-Stepscope-Delivery"
"""The same id on every attempt of one delivery, for receivers that deduplicate."""
_RETRIED_STATUSES = {408, 425, 429}
_QUEUE_SIZE = 1000


def finding_key(finding: Finding) -> str:
    """What identifies a finding across analysis passes (which store findings anew)."""
    identity = [
        finding.kind,
        list(finding.ranks or ()),
        finding.node,
        finding.first_step,
        finding.metric,
        finding.severity,
    ]
    return hashlib.sha256(orjson.dumps(identity)).hexdigest()


def target_key(url: str) -> str:
    """The stored name of a webhook URL (its hash: Slack URLs hold a secret)."""
    return hashlib.sha256(url.encode()).hexdigest()


def payload(finding: Finding) -> dict[str, Any]:
    """The JSON body: `text` for Slack and chat tools, the finding's fields for scripts."""
    line = finding_line(finding)
    doc = {
        "text": f"stepscope: job {finding.job_id}: {line.strip()}",
        "job_id": finding.job_id,
        "finding": {**finding.to_dict(), "text": line},
    }
    sanitized: dict[str, Any] = orjson.loads(orjson.dumps(doc))  # NaN → null, as sent
    return sanitized


def signature(secret: str, body: bytes) -> str:
    """The value of SIGNATURE_HEADER for `body`."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class WebhookSender:
    """A daemon thread delivering findings to webhook URLs, once each, with retries."""

    def __init__(
        self,
        engine: sa.Engine,
        urls: Sequence[str],
        *,
        secret: str | None = None,
        timeout_s: float = 10.0,
        max_attempts: int = 8,
        backoff_s: float = 2.0,
        max_backoff_s: float = 600.0,
        poll_s: float = 5.0,
        on_attempt: Callable[[str], None] | None = None,
    ) -> None:
        self._engine = engine
        self._on_attempt = on_attempt
        """Told each attempt's outcome: delivered, retrying or given_up."""
        self._urls = {target_key(url): url for url in urls}
        self._secret = secret
        self._timeout_s = timeout_s
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._poll_s = poll_s
        self._offers: queue.Queue[tuple[str, list[Finding]] | None] = queue.Queue(_QUEUE_SIZE)
        """Offered findings; None wakes the thread to stop."""
        self._full = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def offer(self, job_id: str, findings: list[Finding]) -> None:
        """Queue a job's current warning/critical findings; never blocks (the FindingsHook)."""
        findings = [f for f in findings if f.severity != "info"]
        if not findings:
            return
        try:
            self._offers.put_nowait((job_id, findings))
            self._full = False
        except queue.Full:  # the next analysis pass offers them again
            if not self._full:
                log.warning("webhook queue full: findings of job %s left for a later pass", job_id)
            self._full = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stepscope-webhooks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; undelivered findings stay in the outbox for the next start."""
        self._stop.set()
        with contextlib.suppress(queue.Full):  # full: the thread's wait returns anyway
            self._offers.put_nowait(None)
        if self._thread is not None:
            self._thread.join(timeout=self._timeout_s + 5)

    def _run(self) -> None:
        with httpx.Client(
            timeout=self._timeout_s, headers={"User-Agent": f"stepscope/{__version__}"}
        ) as client:
            while not self._stop.is_set():
                try:
                    self._store_offers(wait_s=self._poll_s)
                    if not self._stop.is_set():  # claiming would lease deliveries not tried
                        self.deliver_due(client)
                except Exception as exc:  # a database hiccup must not end notifications
                    OUTAGES.failed(exc, log, "webhook delivery pass failed")
                    self._stop.wait(self._poll_s)

    def _store_offers(self, wait_s: float) -> None:
        """Outbox rows for the offered findings (and those offered meanwhile)."""
        try:
            offers = [self._offers.get(timeout=wait_s)]
        except queue.Empty:
            return
        while True:
            try:
                offers.append(self._offers.get_nowait())
            except queue.Empty:
                break
        rows = [
            Delivery(
                job_id=job_id,
                finding_key=finding_key(f),
                target=target,
                payload=payload(f),
                attempts=0,
            )
            for job_id, findings in filter(None, offers)
            for f in findings
            for target in self._urls
        ]
        deliveries.enqueue(self._engine, rows, time.time())

    def deliver_due(self, client: httpx.Client) -> int:
        """POST every due delivery once; how many were delivered."""
        now = time.time()
        due = deliveries.claim_due(
            self._engine,
            now,
            targets=list(self._urls),
            lease_s=self._timeout_s + 30.0,
            limit=100,
        )
        delivered = 0
        for delivery in due:
            if self._stop.is_set():
                break
            delivered += self._attempt(client, delivery)
        return delivered

    def _attempt(self, client: httpx.Client, delivery: Delivery) -> bool:
        body = orjson.dumps(delivery.payload)
        headers = {
            "Content-Type": "application/json",
            DELIVERY_HEADER: f"{delivery.job_id}.{delivery.finding_key[:16]}",
        }
        if self._secret:
            headers[SIGNATURE_HEADER] = signature(self._secret, body)
        retry, error = True, None
        try:
            response = client.post(self._urls[delivery.target], content=body, headers=headers)
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            if response.is_success:
                deliveries.record_attempt(
                    self._engine,
                    delivery,
                    delivered_at=time.time(),
                    next_attempt_at=None,
                    error=None,
                )
                self._told("delivered")
                return True
            error = f"HTTP {response.status_code}: {response.text[:200]}"
            retry = response.status_code >= 500 or response.status_code in _RETRIED_STATUSES
        attempts = delivery.attempts + 1
        next_at = None
        if retry and attempts < self._max_attempts:
            delay = min(self._backoff_s * 2 ** (attempts - 1), self._max_backoff_s)
            next_at = time.time() + delay * random.uniform(0.9, 1.1)
        else:
            log.warning(
                "webhook for job %s given up after %d attempt(s): %s",
                delivery.job_id,
                attempts,
                error,
            )
        deliveries.record_attempt(
            self._engine, delivery, delivered_at=None, next_attempt_at=next_at, error=error
        )
        self._told("retrying" if next_at is not None else "given_up")
        return False

    def _told(self, outcome: str) -> None:
        if self._on_attempt is not None:
            self._on_attempt(outcome)
