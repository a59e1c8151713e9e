"""The demo's server: `stepscope serve`'s app on a loopback port, in a thread of this process."""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from stepscope.server.app import create_app
from stepscope.server.settings import KEEP_ALIVE_S, Settings

ANALYZE_INTERVAL_S = 2.0
"""The background analyzer's period: a live job's findings follow it within seconds."""


@dataclass(slots=True)
class DemoServer:
    """A running server and the thread it runs in."""

    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def wait(self) -> None:
        """Serve until the server stops or Ctrl-C (KeyboardInterrupt reaches the caller)."""
        while self.thread.is_alive():
            self.thread.join(timeout=1)


def start_server(*, database_url: str, port: int, start_timeout_s: float = 60.0) -> DemoServer:
    """Create the app on `database_url` (migrated on start), serve it, return once healthy."""
    settings = Settings(database_url=database_url, port=port, analyze_interval_s=ANALYZE_INTERVAL_S)
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=port,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )
    thread = threading.Thread(target=server.run, name="stepscope-server", daemon=True)
    thread.start()
    url = f"http://{settings.host}:{port}"
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                return DemoServer(app=app, server=server, thread=thread, url=url)
        except OSError:
            if not thread.is_alive():
                raise RuntimeError(f"the server could not listen on port {port}") from None
            time.sleep(0.1)
    raise TimeoutError(f"the server on port {port} did not become healthy")
