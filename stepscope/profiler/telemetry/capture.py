"""Deep capture on demand (#21): record torch.profiler for a few steps when the collector
asks (in the answer to an ingest batch), then upload the trace.

Bounded and fail-open: at most `capture_max_steps` steps and `capture_max_s` seconds, a trace
of at most the server's `max_bytes` gzipped; a capture that cannot start, export or upload
(no torch.profiler, a full disk, any exception) is given up and reported to the collector,
and training goes on as if nothing had been asked. The profiler starts at a step's start
and stops after a step's end; the export, compression and upload run on a thread of their
own.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from stepscope.profiler.config import Config

log = logging.getLogger(__name__)

ENDED_BEFORE_START = "the job ended before the capture started"


@dataclass(frozen=True, slots=True)
class Order:
    """A capture the collector asked for."""

    capture_id: int
    num_steps: int
    upload_path: str
    max_bytes: int

    @classmethod
    def of(cls, doc: Any, *, max_steps: int) -> Order:
        """The order in an ingest answer's "capture"; ValueError if it is not one."""
        if not isinstance(doc, dict):
            raise ValueError("capture must be an object")
        capture_id, num_steps = doc.get("id"), doc.get("num_steps")
        upload, max_bytes = doc.get("upload"), doc.get("max_bytes")
        if not isinstance(capture_id, int) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"capture has no valid id and num_steps: {doc!r}")
        if not isinstance(upload, str) or not upload.startswith("/v1/captures/"):
            raise ValueError(f"capture has no valid upload path: {upload!r}")
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"capture has no valid max_bytes: {max_bytes!r}")
        return cls(capture_id, min(num_steps, max_steps), upload, max_bytes)


class DeepCapture:
    """Holds at most one order and its running torch.profiler; the training thread only
    reads `armed` per step until an order comes."""

    def __init__(
        self,
        *,
        url: str,
        token: str | None,
        http_timeout_s: float,
        max_steps: int,
        max_s: float,
        with_stack: bool,
        directory: str | None,
    ) -> None:
        self._base_url = url.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._http_timeout_s = http_timeout_s
        self._max_steps = max_steps
        self._max_s = max_s
        self._with_stack = with_stack
        self._directory = directory
        self._lock = threading.Lock()
        self._order: Order | None = None
        self._running: Order | None = None
        self._profile: Any = None
        self._first_step: int | None = None
        self._num_steps_done = 0
        self._started_at = 0.0
        self._uploads: list[threading.Thread] = []
        self._closed = False
        self.armed = False
        """An order waits for the next step, or a profile runs: the hot path's one check."""
        self.results: dict[int, str] = {}
        """Capture id → "uploaded" or the error it was given up with (for tests)."""

    # ---- the shipper thread ------------------------------------------------------------

    def offer(self, doc: Any) -> None:
        """Take an order from an ingest answer, once torch.profiler is loaded (the first
        order holds the shipper ~1 s); a second one while busy is refused."""
        try:
            order = Order.of(doc, max_steps=self._max_steps)
        except ValueError as exc:
            log.warning("stepscope: ignored a capture order: %s", exc)
            return
        with self._lock:
            refusal = self._refusal()
        if refusal is None:
            try:
                _load_profiler()
            except Exception as exc:
                refusal = f"torch.profiler did not load: {type(exc).__name__}: {exc}"
        if refusal is None:
            with self._lock:  # the job may have ended meanwhile
                refusal = self._refusal()
                if refusal is None:
                    self._order = order
                    self.armed = True
        if refusal is not None:
            self._give_up(order, refusal)

    def _refusal(self) -> str | None:
        """Why an order cannot be taken now (with the lock held)."""
        if self._closed:
            return ENDED_BEFORE_START
        if self._order is not None or self._running is not None:
            return "another capture is in progress on this rank"
        return None

    # ---- the training thread: never raise ---------------------------------------------

    def before_step(self, step: int) -> None:
        """Start the ordered profile at this step's start, or mark the next recorded step
        (a ProfilerStep#<step> annotation, which the summary uses)."""
        running = self._running
        if running is not None:
            try:
                self._profile.step()
            except Exception as exc:
                self._running, self._profile = None, None
                self.armed = False
                self._give_up(running, f"torch.profiler failed: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            order, self._order = self._order, None
        if order is None:
            return
        try:
            profile = _start_profile(with_stack=self._with_stack, first_step=step)
        except Exception as exc:
            self.armed = False
            self._give_up(order, f"torch.profiler did not start: {type(exc).__name__}: {exc}")
            return
        self._running, self._profile = order, profile
        self._first_step, self._num_steps_done = step, 0
        self._started_at = time.monotonic()

    def after_step(self, step: int) -> None:
        """Count a recorded step; stop and hand over the trace after the last one."""
        if self._running is None:
            return
        self._num_steps_done += 1
        enough = self._num_steps_done >= self._running.num_steps
        if enough or time.monotonic() - self._started_at >= self._max_s:
            self._stop(last_step=step)

    def close(self, timeout_s: float) -> None:
        """Stop a running profile (its steps so far are uploaded), refuse later orders and
        wait for uploads."""
        try:
            if self._running is not None:
                self._stop(last_step=None)
            with self._lock:
                order, self._order = self._order, None
                self._closed, self.armed = True, False
            if order is not None:
                self._give_up(order, ENDED_BEFORE_START)
            deadline = time.monotonic() + timeout_s
            for thread in self._uploads:
                thread.join(max(deadline - time.monotonic(), 0.0))
        except Exception:
            log.debug("stepscope: closing the deep capture failed", exc_info=True)

    def _stop(self, *, last_step: int | None) -> None:
        order, profile, first_step = self._running, self._profile, self._first_step
        self._running, self._profile = None, None
        self.armed = self._order is not None
        assert order is not None
        try:
            profile.stop()
        except Exception as exc:
            self._give_up(order, f"torch.profiler did not stop: {type(exc).__name__}: {exc}")
            return
        thread = threading.Thread(
            target=self._export_and_upload,
            args=(order, profile, first_step, last_step),
            name="stepscope-capture",
            daemon=True,
        )
        self._uploads.append(thread)
        thread.start()

    # ---- the upload thread -------------------------------------------------------------

    def _export_and_upload(
        self, order: Order, profile: Any, first_step: int | None, last_step: int | None
    ) -> None:
        workdir = None
        try:
            workdir = tempfile.mkdtemp(prefix="stepscope-capture-", dir=self._directory)
            path = os.path.join(workdir, "trace.json")
            profile.export_chrome_trace(path)
            trace_gz = _gzip_file(path, limit_bytes=order.max_bytes)
            if trace_gz is None:
                self._give_up(order, f"the trace exceeds {order.max_bytes} bytes gzipped")
                return
            query = "&".join(
                f"{name}={value}"
                for name, value in (("first_step", first_step), ("last_step", last_step))
                if value is not None
            )
            self._post(
                order.upload_path + (f"?{query}" if query else ""),
                trace_gz,
                {"Content-Encoding": "gzip"},
            )
            self.results[order.capture_id] = "uploaded"
        except Exception as exc:
            self._give_up(order, f"{type(exc).__name__}: {exc}")
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)

    def _give_up(self, order: Order, error: str) -> None:
        """Tell the collector why, from a thread of its own (best effort): the training
        thread and the shipper must not wait on it."""
        log.warning("stepscope: deep capture %d given up: %s", order.capture_id, error)
        self.results[order.capture_id] = error
        thread = threading.Thread(
            target=self._report, args=(order, error), name="stepscope-capture", daemon=True
        )
        self._uploads.append(thread)
        thread.start()

    def _report(self, order: Order, error: str) -> None:
        body = json.dumps({"error": error[:1000]}).encode()
        try:
            self._post(f"{order.upload_path}/failure", body, {})
        except Exception as exc:
            log.info("stepscope: could not report capture %d: %s", order.capture_id, exc)

    def _post(self, path: str, body: bytes, headers: dict[str, str]) -> None:
        request = urllib.request.Request(
            self._base_url + path,
            data=body,
            headers={**self._headers, **headers},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self._http_timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise OSError(f"HTTP {exc.code}: {detail}") from exc


def _load_profiler() -> None:
    """Import what torch.profiler's start would import on the training thread: its first
    start reads torch._inductor's config, ~1 s of module imports (the rank would stall, and
    its peers with it)."""
    import torch._inductor.config  # noqa: F401
    import torch.profiler  # noqa: F401


def _start_profile(*, with_stack: bool, first_step: int) -> Any:
    """A started torch.profiler profile of the CPU (and CUDA when present), its steps
    annotated ProfilerStep#<training step>."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(
        activities=activities,
        schedule=_record_every_step,  # a schedule makes it annotate the steps
        with_stack=with_stack,
        record_shapes=False,
    )
    prof.step_num = first_step
    prof.start()
    return prof


def _record_every_step(_step: int) -> Any:
    from torch.profiler import ProfilerAction

    return ProfilerAction.RECORD


def _gzip_file(path: str, *, limit_bytes: int) -> bytes | None:
    """The file gzipped, or None once it exceeds `limit_bytes`."""
    out = io.BytesIO()
    with open(path, "rb") as source, gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6) as gz:
        while chunk := source.read(1 << 20):
            gz.write(chunk)
            if out.tell() > limit_bytes:
                return None
    return out.getvalue() if out.tell() <= limit_bytes else None


def build_capture(config: Config) -> DeepCapture | None:
    """The deep capture of a Config with a collector URL and captures on; else None."""
    if not config.capture or not config.url:
        return None
    return DeepCapture(
        url=config.url,
        token=config.token,
        http_timeout_s=config.http_timeout_s,
        max_steps=config.capture_max_steps,
        max_s=config.capture_max_s,
        with_stack=config.capture_with_stack,
        directory=config.capture_dir,
    )
