"""CLI behaviour that needs no server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("by", ["options", "environment"])
def test_serve_refuses_a_public_address_without_auth(by: str) -> None:
    args, env = ["--host", "0.0.0.0", "--port", "0"], dict(os.environ)
    if by == "environment":
        args = []
        env.update(STEPSCOPE_HOST="0.0.0.0", STEPSCOPE_PORT="0")
    out = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    assert "--auth" in out.stderr
    assert "--allow-unauthenticated" in out.stderr
    assert "Traceback" not in out.stderr


def test_token_create_rejects_an_unknown_scope(tmp_path: object) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepscope.cli",
            "token",
            "create",
            "--scope",
            "write",
            "--db",
            f"sqlite:///{tmp_path}/t.db",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "write" in out.stderr


def test_run_passes_the_job_environment_to_the_command() -> None:
    child = "import os; print(os.environ['STEPSCOPE_JOB_ID'], os.environ['STEPSCOPE_URL'])"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepscope.cli",
            "run",
            "--job-id",
            "llm-7",
            "--url",
            "http://collector:8000",
            "--",
            sys.executable,
            "-c",
            child,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["llm-7", "http://collector:8000"]


def test_run_returns_the_exit_code_of_the_command() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepscope.cli",
            "run",
            "--",
            sys.executable,
            "-c",
            "raise SystemExit(7)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 7
