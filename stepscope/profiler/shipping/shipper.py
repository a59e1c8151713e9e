"""Background shipping of records to the collector: bounded buffers, columnar gzip batches,
retries with backoff and jitter, resend of unacknowledged batches, spill to disk, drop counters.

Only the stdlib is used. Nothing here raises into the caller: `add_*` are O(1) appends
that drop (and count) when the buffer is full, and `close()` waits at most its timeout.
"""

from __future__ import annotations

import email.utils
import gzip
import json
import logging
import random
import re
import threading
import time
import urllib.error
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepscope.profiler.config import Config, default_flush_interval_s
from stepscope.profiler.shipping.transport import Poster
from stepscope.schema import COLLECTIVES, DROP_REPORT_PREFIX, GPU, STEPS, WIRE_SCHEMA_VERSION

log = logging.getLogger(__name__)

KINDS = ("steps", "collectives", "gpu", "events")
_COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": tuple(c.name for c in STEPS.wire_columns),
    "collectives": tuple(c.name for c in COLLECTIVES.wire_columns),
    "gpu": tuple(c.name for c in GPU.wire_columns),
}
_RETRYABLE_STATUS = (408, 429)
_GZIP_LEVEL = 1
"""A batch's compression, on the rank's own CPU: level 1 costs 0.18 ms for a 383-step DDP
batch (72 KB of JSON) where level 6 took 1.03 ms, for 22 % more bytes (35 B a step)."""
_ENCODE_CHUNK_VALUES = 500
"""Values encoded by one json.dumps call. The C encoder holds the GIL for the whole call: a
5,000-row batch (after an outage) in one call would stall the training thread for ~50 ms."""


@dataclass(slots=True)
class _Batch:
    seq: int
    payload: dict[str, Any]
    counts: dict[str, int]
    body_gz: bytes = b""

    def encoded(self) -> bytes:
        if not self.body_gz:
            text = dumps_in_chunks(self.payload).encode()
            self.body_gz = gzip.compress(text, compresslevel=_GZIP_LEVEL)
        return self.body_gz


_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
"""Compact JSON; one encoder for every call (json.dumps with options builds one a call)."""


def _dumps_list(values: list[Any]) -> str:
    step = _ENCODE_CHUNK_VALUES
    return (
        "["
        + ",".join(_dumps(values[i : i + step])[1:-1] for i in range(0, len(values), step))
        + "]"
    )


def dumps_in_chunks(payload: dict[str, Any]) -> str:
    """The batch as compact JSON, its columns and events encoded a few hundred values per call,
    so that the training thread gets the GIL between calls."""
    parts = []
    for key, value in payload.items():
        if isinstance(value, dict) and key in _COLUMNS:
            columns = ",".join(f"{_dumps(c)}:{_dumps_list(v)}" for c, v in value.items())
            parts.append(f"{_dumps(key)}:{{{columns}}}")
        elif isinstance(value, list):
            parts.append(f"{_dumps(key)}:{_dumps_list(value)}")
        else:
            parts.append(f"{_dumps(key)}:{_dumps(value)}")
    return "{" + ",".join(parts) + "}"


@dataclass(kw_only=True, slots=True)
class ShipperStats:
    """Counters of what the shipper did; read them for benchmarks and tests."""

    num_batches_sent: int = 0
    num_bytes_sent: int = 0
    """Gzipped request bodies acknowledged by the collector, in bytes."""
    num_rows_sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    num_dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    num_retries: int = 0
    num_retry_after: int = 0
    """Retries scheduled no earlier than the collector's Retry-After (503 while its database
    is unavailable, 429)."""
    num_rejected_batches: int = 0
    num_spilled_batches: int = 0
    thread_cpu_s: float = 0.0
    """CPU seconds the shipper thread used; set when it stops."""


def node_slot_wait_s(now_s: float, interval_s: float, node: str) -> float:
    """Seconds until the node's next flush slot: the ranks of a node flush together (their
    relay sends them in one request), and the nodes of a job are spread over the interval."""
    phase_s = zlib.crc32(node.encode()) / 2**32 * interval_s
    return interval_s - (now_s - phase_s) % interval_s


def _refused(exc: BaseException) -> bool:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return isinstance(reason, ConnectionRefusedError)


class _SendError(Exception):
    def __init__(self, message: str, *, retryable: bool, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        """How long the collector asked us to wait (its Retry-After), in seconds."""


def retry_after_s(value: str | None) -> float:
    """Seconds from a Retry-After header (delay-seconds or an HTTP date); 0 when absent."""
    if not value:
        return 0.0
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    return max(when.timestamp() - time.time(), 0.0)


class Shipper:
    """Owns the buffers and the thread that posts them to {url}/v1/ingest."""

    def __init__(
        self,
        *,
        config: Config,
        job: dict[str, Any],
        source: dict[str, Any],
        start: bool = True,
        tee: Callable[[str, list[dict[str, Any]]], None] | None = None,
        on_capture: Callable[[Any], None] | None = None,
    ) -> None:
        assert config.url is not None
        self._config = config
        self._tee = tee
        """Also told each batch's step and GPU rows, in this thread (the OTLP export)."""
        self._on_capture = on_capture
        """Told the deep-capture order an ingest answer carries (#21), in this thread."""
        self.before_batch: Callable[[], None] | None = None
        """Called in this thread before it builds batches: the profiler adds the rows of its
        finished steps there (set once, before any step; it catches its own errors)."""
        self._flush_interval_s = config.flush_interval_s or default_flush_interval_s(
            int(job.get("world_size") or 1)
        )
        self._direct_endpoint = config.url.rstrip("/") + "/v1/ingest"
        self._poster = Poster(
            config.relay_url.rstrip("/") + "/v1/ingest"
            if config.relay_url
            else self._direct_endpoint,
            timeout_s=config.http_timeout_s,
        )
        self._headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        if config.token:
            self._headers["Authorization"] = f"Bearer {config.token}"
        self._job = dict(job)
        self._job_changed = False
        self._final_job: dict[str, Any] | None = None
        self._left_unsent = False
        self._source = dict(source)
        self._lock = threading.Lock()
        self._buffers: dict[str, deque[Any]] = {kind: deque() for kind in KINDS}
        self._pending: deque[_Batch] = deque()
        self._seq = 0
        self.stats = ShipperStats()
        self._dropped_reported = dict.fromkeys(KINDS, 0)
        self._drop_lock = threading.Lock()
        """Guards num_dropped: training threads and this one count drops at the same time."""
        self._wake = threading.Event()
        self._flush_now = False
        self._stopping = threading.Event()
        self._deadline = float("inf")
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._last_error: str | None = None
        self._spill_path = self._spill_file(config, job, source)
        self._thread = threading.Thread(target=self._run, name="stepscope-shipper", daemon=True)
        if start:
            self._thread.start()

    # ---- called from training threads: O(1), never raise ------------------------------

    def add(self, kind: str, row: Any) -> None:
        """Buffer one record (a dict of wire columns, or an event dict); drop and count if full."""
        buffer = self._buffers[kind]
        if len(buffer) >= self._config.max_buffer_rows:
            with self._drop_lock:
                self.stats.num_dropped[kind] += 1
            return
        buffer.append(row)

    def update_job(self, *, send: bool = False, **fields: Any) -> None:
        """Change job fields sent with later batches; `send` forces a batch even with no records."""
        with self._lock:
            self._job.update(fields)
            self._job_changed = self._job_changed or send

    def update_source(self, **fields: Any) -> None:
        """Change source fields (this rank's mesh coordinates) sent with later batches."""
        with self._lock:
            self._source = {**self._source, **fields}

    def flush_soon(self) -> None:
        """Batch what is buffered now rather than at the next flush."""
        self._flush_now = True
        self._wake.set()

    def close(
        self, timeout_s: float | None = None, *, final_job: dict[str, Any] | None = None
    ) -> bool:
        """Send what is buffered, waiting at most `timeout_s`; True when all was acknowledged.

        `final_job` (status, ended_at) goes last, in a batch of its own, tried at most twice:
        it must not hold back or endanger the records.
        """
        timeout_s = self._config.close_timeout_s if timeout_s is None else timeout_s
        self._final_job = final_job
        self._retry_at = 0.0  # one prompt retry, whatever the backoff had reached
        self._deadline = time.monotonic() + timeout_s
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s + 1.0)
        return not self._thread.is_alive() and not self._left_unsent

    def num_held_rows(self) -> dict[str, int]:
        """Records of each kind held in memory now: buffered, or in unacknowledged batches."""
        held = {kind: len(buffer) for kind, buffer in self._buffers.items()}
        for batch in list(self._pending):  # list() copies under the GIL: no mutation mid-loop
            for kind, n in batch.counts.items():
                held[kind] += n
        return held

    @property
    def idle(self) -> bool:
        """Nothing buffered or unacknowledged in memory."""
        return not self._pending and not any(self._buffers.values())

    # ---- the shipper thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load_spill()
            # When the buffered records go into a batch next (time.monotonic()). Not after
            # every POST: the rows that arrived during a slow answer would be posted at once,
            # and a collector answering in 50 ms would get a batch from each rank every 50 ms.
            flush_at = 0.0
            while True:
                now = time.monotonic()
                stopping = self._stopping.is_set()
                if stopping and now >= self._deadline:
                    break
                if now >= flush_at or stopping or self._flush_now:
                    self._flush_now = False
                    if self.before_batch is not None:
                        self.before_batch()
                    self._build_batches()
                    flush_at = now + self._flush_wait_s()
                if self._pending and now >= self._retry_at:
                    self._send_oldest()
                    continue
                if stopping and not self._pending and not any(self._buffers.values()):
                    if self._final_job is not None:
                        self._send_final_job()
                    break
                wait_s = flush_at - now
                if self._pending:
                    wait_s = min(wait_s, self._retry_at - now)
                if stopping:
                    wait_s = min(wait_s, self._deadline - now)
                self._wake.wait(max(wait_s, 0.0))
                self._wake.clear()
        except Exception:  # a shipper bug must not take the process down
            log.exception("stepscope shipper stopped after an internal error")
        finally:
            self._poster.close()
            self.stats.thread_cpu_s = time.thread_time()
            self._left_unsent = bool(self._pending) or any(self._buffers.values())
            self._spill_all_pending()
            with self._drop_lock:
                for kind, buffer in self._buffers.items():
                    self.stats.num_dropped[kind] += len(buffer)
                    buffer.clear()

    def _flush_wait_s(self) -> float:
        """Seconds from one flush to the next."""
        if self._poster.url != self._direct_endpoint:
            return node_slot_wait_s(
                time.time(), self._flush_interval_s, str(self._source.get("node"))
            )
        # Jitter keeps the ranks of a large job from posting in lockstep.
        return self._flush_interval_s * random.uniform(0.9, 1.1)

    def _build_batches(self) -> None:
        while any(self._buffers.values()) or self._job_changed:
            if self._pending and not self._full_batch_buffered():
                # While batches wait for the collector, records wait in the buffer until they
                # fill a batch: an outage then costs max_buffer_rows, not max_pending_batches
                # batches of a few rows each (which would overflow into drops much sooner).
                return
            batch = self._next_batch()
            if len(self._pending) >= self._config.max_pending_batches:
                if not self._spill(batch):
                    self._drop(batch)
                continue
            self._pending.append(batch)

    def _full_batch_buffered(self) -> bool:
        return any(len(b) >= self._config.max_batch_rows for b in self._buffers.values())

    def _next_batch(self) -> _Batch:
        limit = self._config.max_batch_rows
        payload: dict[str, Any] = {"schema": WIRE_SCHEMA_VERSION}
        with self._lock:
            payload["job"] = dict(self._job)
            payload["source"] = self._source
            self._job_changed = False
        payload["seq"] = self._seq
        counts: dict[str, int] = {}
        for kind in KINDS:
            buffer = self._buffers[kind]
            rows = [buffer.popleft() for _ in range(min(limit, len(buffer)))]
            if not rows:
                continue
            counts[kind] = len(rows)
            if self._tee is not None and kind in ("steps", "gpu"):
                self._tee(kind, rows)
            if kind == "events":
                payload[kind] = rows
            else:
                payload[kind] = {c: [row.get(c) for row in rows] for c in _COLUMNS[kind]}
        batch = _Batch(seq=self._seq, payload=payload, counts=counts)
        self._seq += 1
        return batch

    def _send_oldest(self) -> None:
        batch = self._pending[0]
        try:
            self._post(batch.encoded())
        except _SendError as exc:
            if exc.retryable:
                self.stats.num_retries += 1
                self._schedule_retry(str(exc), exc.retry_after_s)
                return
            self._pending.popleft()
            self.stats.num_rejected_batches += 1
            self._drop(batch)
            log.warning("stepscope collector rejected batch %d: %s", batch.seq, exc)
            return
        self._pending.popleft()
        self.stats.num_batches_sent += 1
        self.stats.num_bytes_sent += len(batch.body_gz)
        for kind, n in batch.counts.items():
            self.stats.num_rows_sent[kind] += n
        if self._last_error is not None:
            log.info("stepscope collector reachable again after: %s", self._last_error)
            self._last_error = None
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._report_drops()
        if not self._pending:
            self._load_spill()

    def _send_final_job(self) -> None:
        with self._lock:
            self._job.update(self._final_job or {})
        self._final_job = None
        batch = self._next_batch()
        # Twice at least; then, while close()'s deadline allows, after a short pause: a
        # collector busy writing other ranks' last batches (503) must not leave the job running.
        for attempt in range(1, 1_000):
            try:
                self._post(batch.encoded())
                return
            except _SendError as exc:
                left_s = self._deadline - time.monotonic()
                if not exc.retryable or (attempt >= 2 and left_s <= 0):
                    break
                time.sleep(max(0.0, min(0.1 * attempt, left_s)))
        log.info("stepscope: the job's final status was not acknowledged")

    def _post(self, body: bytes) -> None:
        try:
            answer = self._poster.post(body, self._headers)
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            retryable = exc.code >= 500 or exc.code in _RETRYABLE_STATUS
            raise _SendError(
                f"HTTP {exc.code}: {detail}",
                retryable=retryable,
                retry_after_s=retry_after_s(exc.headers.get("Retry-After")),
            ) from exc
        except (OSError, ValueError) as exc:  # URLError, timeouts, resets, bad status lines
            if self._poster.url != self._direct_endpoint and _refused(exc):
                log.warning("stepscope node relay is gone (%s); posting to the collector", exc)
                self._poster.close()
                self._poster = Poster(self._direct_endpoint, timeout_s=self._config.http_timeout_s)
            raise _SendError(f"{type(exc).__name__}: {exc}", retryable=True) from exc
        if self._on_capture is not None and b'"capture"' in answer:
            self._offer_capture(answer)

    def _offer_capture(self, answer: bytes) -> None:
        try:
            order = json.loads(answer).get("capture")
            if order is not None:
                self._on_capture(order)  # type: ignore[misc]
        except Exception:  # a capture must never cost the records
            log.warning("stepscope: could not take a capture order", exc_info=True)

    def _schedule_retry(self, error: str, retry_after_s: float = 0.0) -> None:
        if self._last_error is None:
            log.warning("stepscope collector unreachable (%s); will retry", error)
        self._last_error = error
        base_s = min(self._flush_interval_s, 0.5)
        self._backoff_s = min(max(self._backoff_s * 2.0, base_s), self._config.backoff_max_s)
        # Full jitter keeps thousands of ranks from retrying in lockstep.
        delay_s = random.uniform(0.5, 1.0) * self._backoff_s
        if retry_after_s > 0:
            # Not before the collector asked (spread over a fifth more, for the same reason),
            # nor later than our own longest pause.
            asked_s = retry_after_s * random.uniform(1.0, 1.2)
            delay_s = min(max(delay_s, asked_s), self._config.backoff_max_s)
            self.stats.num_retry_after += 1
        self._retry_at = time.monotonic() + delay_s

    def _drop(self, batch: _Batch) -> None:
        with self._drop_lock:
            for kind, n in batch.counts.items():
                self.stats.num_dropped[kind] += n
        for event in batch.payload.get("events", ()):
            # A drop report lost with this batch: its counts go out again with the next one.
            if str(event.get("message", "")).startswith(DROP_REPORT_PREFIX):
                for key, n in event["attributes"].items():
                    self._dropped_reported[key.removeprefix("dropped_")] -= n

    def _report_drops(self) -> None:
        with self._drop_lock:
            dropped = dict(self.stats.num_dropped)
        new = {k: dropped[k] - self._dropped_reported[k] for k in KINDS}
        if not any(new.values()):
            return
        self._dropped_reported = dropped
        total = sum(new.values())
        self._buffers["events"].append(
            {
                "ts": time.time(),
                "kind": "custom",
                "message": f"{DROP_REPORT_PREFIX}{total} records (buffer full or collector "
                "unreachable)",
                "attributes": {f"dropped_{k}": n for k, n in new.items()},
            }
        )
        self._flush_now = True  # the collector is back: say what it missed at once

    # ---- spill file ----------------------------------------------------------------------

    @staticmethod
    def _spill_file(config: Config, job: dict[str, Any], source: dict[str, Any]) -> Path | None:
        if not config.spill_dir:
            return None
        safe_job_id = re.sub(r"[^A-Za-z0-9_.-]", "_", str(job.get("job_id", "job")))
        return Path(config.spill_dir) / f"stepscope-{safe_job_id}-rank{source['rank']}.jsonl"

    def _spill(self, batch: _Batch) -> bool:
        path = self._spill_path
        if path is None:
            return False
        try:
            line = json.dumps(batch.payload, separators=(",", ":")) + "\n"
            size = path.stat().st_size if path.exists() else 0
            if size + len(line) > self._config.spill_max_bytes:
                return False
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(line)
        except OSError as exc:
            log.warning("stepscope could not spill to %s: %s", path, exc)
            return False
        self.stats.num_spilled_batches += 1
        return True

    def _spill_all_pending(self) -> None:
        while self._pending:
            batch = self._pending.popleft()
            if not self._spill(batch):
                self._drop(batch)

    def _load_spill(self) -> None:
        path = self._spill_path
        if path is None or not path.exists():
            return
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            room = self._config.max_pending_batches - len(self._pending)
            for line in lines[:room]:
                payload = json.loads(line)
                counts = {k: _num_rows(payload.get(k)) for k in KINDS if k in payload}
                self._pending.append(_Batch(seq=payload["seq"], payload=payload, counts=counts))
            rest = lines[room:]
            if rest:
                path.write_text("".join(line + "\n" for line in rest), encoding="utf-8")
            else:
                path.unlink()
        except (OSError, ValueError, KeyError) as exc:
            log.warning("stepscope could not read spill file %s: %s", path, exc)


def _num_rows(section: Any) -> int:
    if isinstance(section, list):
        return len(section)
    if isinstance(section, dict) and section:
        return len(next(iter(section.values())))
    return 0
