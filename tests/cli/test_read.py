"""The CLI that reads: jobs, show, findings, export (and analyze's lines), against a
database (--db) and a server (--url, --token)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from stepscope import schema
from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.store import frames
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.store.tokens import create_token
from stepscope.synthetic.generate import JobSpec, Straggler, generate
from tests.live_server import RunningServer, run_server
from tests.support import write_job_in_rounds

JOB = "cli-job"
STRAGGLER = 5


@dataclass(frozen=True, slots=True)
class Stored:
    db_url: str
    server: RunningServer
    """The same database served with auth on."""
    token: str
    """A read token."""


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stored]:
    """A SQLite database with an analysed job whose rank 5 straggles from step 200."""
    db_url = f"sqlite:///{tmp_path_factory.mktemp('cli') / 'stepscope.db'}"
    engine = make_engine(db_url)
    upgrade(engine)
    spec = JobSpec(
        job_id=JOB,
        num_ranks=8,
        ranks_per_node=4,
        num_steps=400,
        spike_prob=0.0,
        stragglers=(Straggler(ranks=(STRAGGLER,), factor=1.3, cause="compute", from_step=200),),
        start_ts=time.time() - 200,
    )
    for _ in write_job_in_rounds(engine, generate(spec), steps_per_batch=100):
        pass
    JobAnalyzer(engine, JOB, grace_s=0).run()
    token = create_token(engine, name="cli", scopes=["read"])
    engine.dispose()
    with run_server(db_url, extra_args=["--auth"]) as server:
        yield Stored(db_url=db_url, server=server, token=token)


def stepscope(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    return subprocess.run(
        [sys.executable, "-m", "stepscope.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "COLUMNS": "80"},
    )


def test_jobs_lists_the_stored_job(stored: Stored) -> None:
    text = stepscope("jobs", "--db", stored.db_url)
    as_json = stepscope("jobs", "--db", stored.db_url, "--format", "json")

    assert text.returncode == 0, text.stderr
    assert JOB in text.stdout
    assert "finished" in text.stdout
    assert all(len(line) <= 80 for line in text.stdout.splitlines())
    (job,) = json.loads(as_json.stdout)["jobs"]
    assert (job["job_id"], job["world_size"], job["status"]) == (JOB, 8, "finished")


def test_show_prints_the_summary_and_the_straggler_in_one_line(stored: Stored) -> None:
    out = stepscope("show", JOB, "--db", stored.db_url)

    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"job {JOB} (synthetic 8x400): finished"
    assert any(line.startswith("size           8 ranks on 2 node(s)") for line in lines)
    assert any(line.startswith("step time      p50") for line in lines)
    (straggler,) = [line for line in lines if "straggler since step" in line]
    assert straggler.split()[:4] == ["critical", "rank", str(STRAGGLER), "(node-0001)"]
    assert "compute +" in straggler
    assert all(len(line) <= 80 for line in lines)


def test_findings_read_alike_from_the_database_and_the_server(stored: Stored) -> None:
    from_db = stepscope("findings", JOB, "--db", stored.db_url)
    from_server = stepscope("findings", JOB, "--url", stored.server.url, "--token", stored.token)
    as_json = stepscope(
        "findings", JOB, "--url", stored.server.url, "--token", stored.token, "--format", "json"
    )
    served = httpx.get(
        f"{stored.server.url}/api/v1/jobs/{JOB}/findings",
        headers={"Authorization": f"Bearer {stored.token}"},
    ).json()

    assert from_db.returncode == from_server.returncode == 0, from_server.stderr
    assert from_db.stdout == from_server.stdout
    # a finding's line, then, indented, the job-level changes it explains and where in the
    # mesh it is (when the analysis says)
    lines = [line for line in from_db.stdout.splitlines() if not line.startswith("  ")]
    assert lines == [f["text"] for f in served if not f["kind"].startswith("throughput_")]
    assert json.loads(as_json.stdout) == served


def test_analyze_prints_findings_in_the_same_lines(stored: Stored) -> None:
    analyzed = stepscope("analyze", JOB, "--db", stored.db_url)
    listed = stepscope("findings", JOB, "--db", stored.db_url)

    assert analyzed.returncode == 0, analyzed.stderr
    assert analyzed.stdout == listed.stdout
    assert "straggler since step" in analyzed.stdout


@pytest.mark.parametrize("source", ["db", "url"])
def test_export_writes_the_stored_rows(stored: Stored, source: str, tmp_path: Path) -> None:
    target = tmp_path / "steps.parquet"
    where = (
        ["--db", stored.db_url]
        if source == "db"
        else ["--url", stored.server.url, "--token", stored.token]
    )
    out = stepscope(
        "export", JOB, "--table", "steps", "--format", "parquet", "-o", str(target), *where
    )
    engine = make_engine(stored.db_url)
    rows = frames.read_frame(engine, "steps", JOB)
    nodes = frames.read_frame(engine, "ranks", JOB, columns=["rank", "node"])
    engine.dispose()

    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stderr
    back = pl.read_parquet(target)
    assert back.columns == list(schema.STEPS.names)
    assert_frame_equal(back, rows.join(nodes, on="rank", how="left").select(schema.STEPS.names))
    assert not (tmp_path / "steps.parquet.part").exists()


def test_export_to_stdout_as_csv(stored: Stored) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "export", JOB, "--table", "findings"]
        + ["--format", "csv", "-o", "-", "--db", stored.db_url],
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "straggler_rank" in pl.read_csv(io.BytesIO(out.stdout))["kind"].to_list()


def test_errors_are_one_line_without_a_traceback(stored: Stored, tmp_path: Path) -> None:
    unknown = stepscope("show", "nope", "--db", stored.db_url)
    unknown_served = stepscope(
        "findings", "nope", "--url", stored.server.url, "--token", stored.token
    )
    no_token = stepscope("findings", JOB, "--url", stored.server.url)
    no_database = stepscope("jobs", "--db", f"sqlite:///{tmp_path / 'missing.db'}")
    bad_filter = stepscope("jobs", "--db", stored.db_url, "--status", "paused")
    down = stepscope("jobs", "--url", "http://127.0.0.1:9")

    for out in (unknown, unknown_served, no_token, no_database, bad_filter, down):
        assert out.returncode != 0
        assert "Traceback" not in out.stderr
        assert out.stderr.startswith("error:"), out.stderr
    assert "no job 'nope'" in unknown.stderr
    assert "no job 'nope'" in unknown_served.stderr
    assert "--token" in no_token.stderr
    assert "no database" in no_database.stderr
    assert not (tmp_path / "missing.db").exists()
    assert "status" in bad_filter.stderr
    assert "cannot reach" in down.stderr


def test_serve_rejects_a_webhook_that_is_not_http() -> None:
    out = stepscope("serve", "--port", "0", "--webhook", "ftp://hooks.example/x")
    assert out.returncode == 2
    assert "ftp://hooks.example/x" in out.stderr
    assert "Traceback" not in out.stderr
