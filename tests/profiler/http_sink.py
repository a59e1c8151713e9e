"""A loopback HTTP endpoint that answers /v1/ingest with scripted statuses and keeps the bodies
(and keeps the profiler's /v1/hangs reports apart, always answered 200).

For the shipper's failure paths (5xx, 4xx, dropped connections) that a healthy collector
never produces; the happy path is tested against the real collector.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Sink:
    url: str
    statuses: list[int] = field(default_factory=list)
    """Statuses to answer, in order; 200 once exhausted."""
    received: list[dict[str, Any]] = field(default_factory=list)
    """Every request body (decoded), whatever the answer."""
    body_bytes: list[int] = field(default_factory=list)
    arrived_s: list[float] = field(default_factory=list)
    """time.monotonic() of each /v1/ingest request."""
    retry_after: str | None = None
    """Retry-After sent with every answer that is not 200."""
    answer_delay_s: float = 0.0
    """How long each /v1/ingest answer takes (a busy collector)."""
    hangs: list[dict[str, Any]] = field(default_factory=list)
    """Every /v1/hangs report (heartbeats and hangs), decoded, in arrival order."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def accepted(self) -> list[dict[str, Any]]:
        """Bodies that were answered 200 (deduplicated by source incarnation and seq)."""
        seen: dict[tuple[str, int], dict[str, Any]] = {}
        for body in self.received:
            if body.get("_status") == 200:
                seen[(body["source"]["incarnation"], body["seq"])] = body
        return list(seen.values())


@contextmanager
def http_sink() -> Iterator[Sink]:
    sink = Sink(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            body = json.loads(raw)
            if self.path == "/v1/hangs":
                with sink.lock:
                    sink.hangs.append(body)
                self._reply(200, json.dumps({"ok": True}))
                return
            with sink.lock:
                sink.arrived_s.append(time.monotonic())
                status = sink.statuses.pop(0) if sink.statuses else 200
                body["_status"] = status
                sink.received.append(body)
                sink.body_bytes.append(int(self.headers["Content-Length"]))
            time.sleep(sink.answer_delay_s)
            headers = (
                {"Retry-After": sink.retry_after} if status != 200 and sink.retry_after else {}
            )
            self._reply(
                status,
                json.dumps({"duplicate": False} if status == 200 else {"detail": "x"}),
                headers,
            )

        def _reply(self, status: int, reply: str, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply.encode())

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    sink.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield sink
    finally:
        server.shutdown()
        server.server_close()
