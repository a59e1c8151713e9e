"""A real `stepscope serve` on a loopback port, for tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from stepscope.store.engine import make_engine


@dataclass(frozen=True, slots=True)
class RunningServer:
    url: str
    port: int
    db_url: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(
    url: str, timeout_s: float = 30.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}: {proc.stderr and proc.stderr.read()!r}"
            )
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"server at {url} not healthy after {timeout_s} s")


def serve_command(db_url: str, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    """The command line of `stepscope serve` on a loopback port."""
    return [
        *(sys.executable, "-m", "stepscope.cli", "serve"),
        *("--host", "127.0.0.1", "--port", str(port), "--db", db_url),
        *extra_args,
    ]


class ServerProcess:
    """A `stepscope serve` that a test kills and starts again on the same port and database;
    its stderr goes to `log_path` (read it with `log()`)."""

    def __init__(
        self,
        db_url: str,
        *,
        log_path: Path,
        port: int | None = None,
        extra_args: Sequence[str] = ("--analyze-interval", "0"),
        env: dict[str, str] | None = None,
    ) -> None:
        self.db_url = db_url
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._args = list(extra_args)
        self._env = {**os.environ, **(env or {})}
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait until it answers /healthz."""
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                serve_command(self.db_url, self.port, self._args),
                cwd=self.log_path.parent,
                env=self._env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        wait_healthy(self.url, proc=self._proc)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush, as when a node dies."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers, as when a node hangs."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause(): the server answers what waited, then carries on."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Terminate gracefully (SIGKILL after 10 s)."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def peak_rss_bytes(self) -> int:
        """The server process's peak resident memory so far (Linux), in bytes."""
        assert self._proc is not None
        status = Path(f"/proc/{self._proc.pid}/status").read_text()
        [line] = [line for line in status.splitlines() if line.startswith("VmHWM:")]
        return int(line.split()[1]) * 1024

    def cpu_s(self) -> float:
        """CPU seconds (user + system, all threads) the server process used so far (Linux)."""
        assert self._proc is not None
        fields = Path(f"/proc/{self._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


@contextmanager
def run_server(
    db_url: str | None = None,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[RunningServer]:
    """Start `stepscope serve` in a subprocess and stop it on exit."""
    with tempfile.TemporaryDirectory(prefix="stepscope-test-") as tmp:
        db_url = db_url or f"sqlite:///{Path(tmp) / 'stepscope.db'}"
        port = port or free_port()
        proc = subprocess.Popen(
            serve_command(db_url, port, ["--analyze-interval", "0", *extra_args]),
            cwd=tmp,
            env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc=proc)
            yield RunningServer(url=url, port=port, db_url=db_url)
        finally:
            stop(proc)


@contextmanager
def server_on(engine_name: str) -> Iterator[RunningServer]:
    """A server on a new "sqlite" file or a new, migrated "postgresql" database."""
    if engine_name == "sqlite":
        with run_server() as running:
            yield running
        return
    from stepscope.store.migrate import upgrade
    from tests.support import fresh_postgres_database

    with fresh_postgres_database() as db_url:
        engine = make_engine(db_url)
        upgrade(engine)
        engine.dispose()
        with run_server(db_url) as running:
            yield running


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """Terminate a process this test started, and kill it if it does not exit in time."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def database_with_tokens(db_url: str, scopes: Sequence[str]) -> dict[str, str]:
    """Migrate a new database and create a token per scope; scope → token."""
    from stepscope.store.migrate import upgrade
    from stepscope.store.tokens import create_token

    engine = make_engine(db_url)
    try:
        upgrade(engine)
        return {s: create_token(engine, name=s, scopes=[s]) for s in scopes}
    finally:
        engine.dispose()


def post_batch(url: str, doc: dict[str, Any]) -> dict[str, Any]:
    """POST one wire batch (plain JSON) to the collector at `url`; its answer (HTTPError for
    an answer that is not 2xx)."""
    request = urllib.request.Request(
        url + "/v1/ingest",
        data=json.dumps(doc).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def read_rows(db_url: str, table: str, job_id: str | None) -> list[dict[str, Any]]:
    """Stored rows of `table` for `job_id` (all rows when None), as dicts."""
    engine = make_engine(db_url)
    try:
        t = sa.Table(table, sa.MetaData(), autoload_with=engine)
        with engine.connect() as conn:
            query = sa.select(t) if job_id is None else sa.select(t).where(t.c.job_id == job_id)
            return [dict(r) for r in conn.execute(query).mappings()]
    finally:
        engine.dispose()
