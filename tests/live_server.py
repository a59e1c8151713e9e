"""A real `stepscope serve` on a loopback port, for tests."""

from __future__ import annotations

import os
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
        cmd = [
            sys.executable,
            "-m",
            "stepscope.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--db",
            db_url,
            "--analyze-interval",
            "0",
            *extra_args,
        ]
        proc = subprocess.Popen(
            cmd,
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
