"""Test helpers: what a test needs from the machine, and how to say it is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

IN_CI = os.environ.get("CI") == "true"
POSTGRES_URL = os.environ.get(
    "STEPSCOPE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def require(available: bool, what: str) -> None:
    """Fail under CI=true, skip locally, when a real dependency of the test is missing."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true but is not available")
    pytest.skip(f"{what} is not available here")


def torchrun_path() -> str | None:
    """The torchrun next to this interpreter, if torch is installed."""
    candidate = Path(sys.executable).with_name("torchrun")
    return str(candidate) if candidate.exists() else shutil.which("torchrun")


def require_torchrun() -> str:
    path = torchrun_path()
    require(path is not None, "torchrun (pip install 'stepscope[torch]')")
    assert path is not None
    return path


def postgres_available() -> bool:
    try:
        import psycopg

        with psycopg.connect(_psycopg_dsn(POSTGRES_URL), connect_timeout=3):
            return True
    except Exception:
        return False


def _psycopg_dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new, empty PostgreSQL database for one test; dropped afterwards."""
    import psycopg

    require(postgres_available(), f"PostgreSQL at {POSTGRES_URL}")
    name = f"stepscope_test_{uuid.uuid4().hex[:12]}"
    admin = _psycopg_dsn(POSTGRES_URL)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def assert_one_outage_logged(caplog: pytest.LogCaptureFixture) -> None:
    """What was logged (WARNING and up) is an ongoing outage's line alone, no traceback; the
    outage is then ended here, which logs its second line."""
    from stepscope.store.availability import OUTAGES

    assert OUTAGES.ongoing, caplog.messages
    OUTAGES.available()
    assert [r.exc_info for r in caplog.records] == [None, None], caplog.messages
    assert caplog.messages[0].startswith("database unavailable ("), caplog.messages
    assert caplog.messages[1].startswith("database available again after"), caplog.messages


def write_job_in_rounds(engine: Any, job: Any, *, steps_per_batch: int = 25) -> Iterator[int]:
    """Store a synthetic job round by round (stepscope.synthetic.stream.store_rounds)."""
    from stepscope.synthetic.stream import store_rounds

    return store_rounds(engine, job, steps_per_batch=steps_per_batch)


@dataclass(slots=True)
class ThrowawayPostgres:
    """A PostgreSQL cluster of the test's own, in a temporary directory on a free port."""

    data_dir: Path
    port: int
    run_as: list[str]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [*self.run_as, str(_pg_bin("pg_ctl")), "-D", str(self.data_dir / "data"), *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-l", str(self.data_dir / "log"), "-w", "-o", options, "start")

    def stop(self) -> None:
        """A fast shutdown: sessions are terminated, as in a restart by an operator."""
        self._ctl("-m", "fast", "-w", "stop")


def _pg_bin(name: str) -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if found:
        return found[-1]
    return Path(shutil.which(name) or name)


@contextmanager
def throwaway_postgres() -> Iterator[ThrowawayPostgres]:
    """Start a new PostgreSQL cluster (initdb + pg_ctl) that a test may stop and restart; the
    shared server is never touched. As root, the cluster runs as the `postgres` user."""
    import socket
    import tempfile

    initdb = _pg_bin("initdb")
    require(initdb.exists(), "PostgreSQL's initdb and pg_ctl")
    run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    with tempfile.TemporaryDirectory(prefix="stepscope-pg-") as tmp:
        data_dir = Path(tmp)
        if run_as:
            shutil.chown(data_dir, user="postgres")
        subprocess.run(
            [*run_as, str(initdb), "-D", str(data_dir / "data"), "-A", "trust", "-U", "postgres"]
            + ["--no-sync", "-E", "UTF8"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=120,
        )
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        cluster = ThrowawayPostgres(data_dir=data_dir, port=port, run_as=run_as)
        cluster.start()
        try:
            yield cluster
        finally:
            try:
                cluster._ctl("-m", "immediate", "-w", "stop")
            except subprocess.CalledProcessError:
                pass  # already stopped


PROMETHEUS = os.environ.get("STEPSCOPE_TEST_PROMETHEUS", "/usr/bin/prometheus")


def require_prometheus() -> str:
    """Debian's prometheus binary (`.ci/run` installs it)."""
    path = PROMETHEUS if Path(PROMETHEUS).exists() else shutil.which("prometheus")
    require(path is not None, "a Prometheus server (apt-get install prometheus)")
    assert path is not None
    return path


def require_docker_compose() -> str:
    """Debian's docker-compose (v1; `config` needs no Docker engine; `.ci/run` installs it)."""
    path = shutil.which("docker-compose")
    require(path is not None, "docker-compose (apt-get install docker-compose)")
    assert path is not None
    return path
