"""CLI behaviour that needs no server."""

from __future__ import annotations

import subprocess
import sys


def test_serve_refuses_a_public_address_without_auth() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
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
