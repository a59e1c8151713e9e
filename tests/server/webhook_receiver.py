"""A loopback HTTP receiver of webhooks: scripted statuses, every request kept raw."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True, slots=True)
class Received:
    body: bytes
    headers: dict[str, str]
    status: int
    """What the receiver answered."""
    path: str = "/hook"


@dataclass
class Receiver:
    url: str
    statuses: list[int] = field(default_factory=list)
    """Statuses to answer, in order; 200 once exhausted."""
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_for(self, done: Callable[[list[Received]], bool], timeout_s: float = 30.0) -> None:
        """Wait until `done(requests)` holds; fail after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if done(list(self.requests)):
                    return
            time.sleep(0.05)
        raise AssertionError(f"receiver saw {len(self.requests)} request(s) in {timeout_s} s")


@contextmanager
def webhook_receiver() -> Iterator[Receiver]:
    """A receiver on a free loopback port, stopped on exit."""
    receiver = Receiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with receiver.lock:
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                headers = {k.lower(): v for k, v in self.headers.items()}
                receiver.requests.append(
                    Received(body=body, headers=headers, status=status, path=self.path)
                )
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
