"""`stepscope demo` end to end: server, streamed synthetic job, analysis."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.live_server import free_port, read_rows


def test_demo_streams_a_job_and_names_the_slow_ranks(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'demo.db'}"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepscope.cli",
            "demo",
            "--exit",
            "--port",
            str(free_port()),
            "--db",
            db_url,
            "--ranks",
            "16",
            "--steps",
            "400",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "240"},
    )
    assert out.returncode == 0, out.stderr
    # One line per finding: "critical  rank 5 (node-0000)  straggler since step 200  compute +25%…"
    straggler = re.compile(r"\brank (\d+)\b.*\bstraggler\b.*?\b(compute|data|comm)\b")
    named = {m.groups() for line in out.stdout.splitlines() if (m := straggler.search(line))}
    assert named == {("5", "compute"), ("11", "data")}
    (job,) = read_rows(db_url, "jobs", None)
    assert job["status"] == "finished"
    assert len(read_rows(db_url, "steps", job["job_id"])) == 16 * 400
    stored = read_rows(db_url, "findings", job["job_id"])
    assert {(tuple(f["ranks"]), f["cause"]) for f in stored if f["kind"] == "straggler_rank"} == {
        ((5,), "compute"),
        ((11,), "data"),
    }
