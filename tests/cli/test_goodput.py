"""`stepscope goodput JOB` and the goodput lines of `stepscope show`, from a server and a
database alike."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from stepscope.synthetic.goodput_timelines import Failure, Scenario, generate
from stepscope.text.labels import goodput_category
from stepscope.text.numbers import share
from tests.goodput_jobs import batches
from tests.live_server import RunningServer, run_server

JOB = "cli-goodput"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    timeline = generate(
        Scenario(
            world_size=4,
            num_steps=100,
            ckpt_every=20,
            failures=[Failure(at_step=50, rank=3, downtime_s=40.0)],
            rank_rows=True,
            seed=3,
        )
    )
    with run_server() as running, httpx.Client(base_url=running.url, timeout=60) as client:
        for batch in batches(timeline, JOB):
            assert client.post("/v1/ingest", json=batch).status_code == 200
        assert client.post(f"/api/v1/jobs/{JOB}/analyze").status_code == 200
        yield running


def cli(*args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", *args], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_goodput_prints_one_line_per_category_within_80_columns(server: RunningServer) -> None:
    doc = httpx.get(f"{server.url}/api/v1/jobs/{JOB}/goodput").json()
    for source in (("--url", server.url), ("--db", server.db_url)):
        out = cli("goodput", JOB, *source)
        lines = out.splitlines()
        assert all(len(line) <= 80 for line in lines), out
        assert lines[0].startswith(f"goodput        {share(doc['goodput'])} of ")
        assert "1 restart(s)" in lines[0]
        [lost] = [line for line in lines if line.strip().startswith("lost progress")]
        assert lost.endswith("(rank 3)")
        assert not any("unaccounted" in line and "-0.0" in line for line in lines)
        assert share(doc["categories"]["lost_progress"]["share"]) in lost
        [first] = [line for line in lines if line.startswith("incarnation 0")]
        assert "lost 40-49" in first
        assert "rank 3: RuntimeError: injected" in first


def test_show_prints_the_goodput_and_its_top_causes(server: RunningServer) -> None:
    out = cli("show", JOB, "--db", server.db_url)
    [headline] = [line for line in out.splitlines() if line.startswith("goodput ")]
    [top] = [line for line in out.splitlines() if line.startswith("top badput")]
    assert "GPU-h lost" in headline
    assert "restart" in top
    assert len(top) <= 80


def test_goodput_since_prints_the_fleet_from_a_server_and_a_database(
    server: RunningServer,
) -> None:
    job = httpx.get(f"{server.url}/api/v1/jobs/{JOB}/goodput").json()
    middle = (job["started_at"] + job["ended_at"]) / 2
    window = {"since": job["started_at"], "until": middle}
    fleet = httpx.get(f"{server.url}/api/v1/goodput", params=window).json()
    assert fleet["gpu_hours"] == pytest.approx(
        job["world_size"] * (middle - job["started_at"]) / 3600
    )
    for source in (("--url", server.url), ("--db", server.db_url)):
        everything = cli("goodput", "--since", "1970-01-01T00:00", *source).splitlines()
        assert everything[0].startswith(
            f"goodput {share(job['goodput'])} of {job['total_gpu_s'] / 3600:,.2f} GPU-h "
            "over 1 job(s)"
        )
        [row] = [line for line in everything if line.startswith(f"{JOB}: ")]
        largest = max(
            (c for c in job["categories"] if c != "productive"),
            key=lambda c: job["categories"][c]["gpu_s"],
        )
        assert f"most lost: {goodput_category(largest)} " in row
        part = cli("goodput", "--since", str(window["since"]), "--until", str(middle), *source)
        first = part.splitlines()[0]
        assert first.startswith(f"goodput {share(fleet['goodput'])} of ")
        assert all(len(line) <= 80 for line in part.splitlines())
    both = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "goodput", JOB, "--since", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert both.returncode == 2
    assert "not both" in both.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "goodput", "--since", "yesterday"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert "--since must be epoch seconds or an ISO 8601 time" in bad.stderr
