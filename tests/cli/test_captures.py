"""`stepscope capture` and `stepscope captures` against a real server (auth on) and its
database: ask, list, download, and errors said in one line."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from stepscope.synthetic.generate import JobSpec, generate
from tests.cli.test_read import stepscope
from tests.collector.test_captures import SLOW_FUNCTION, live_batches, trace
from tests.live_server import RunningServer, database_with_tokens, run_server

JOB = "cli-capture"


@dataclass(frozen=True, slots=True)
class Served:
    server: RunningServer
    tokens: dict[str, str]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server with auth on and a live 3-rank job that has sent one batch per rank."""
    db_url = f"sqlite:///{tmp_path_factory.mktemp('cli-capture') / 'stepscope.db'}"
    tokens = database_with_tokens(db_url, ("read", "ingest"))
    with run_server(db_url, extra_args=["--auth"]) as server:
        job = generate(JobSpec(job_id=JOB, num_ranks=3, num_steps=60, spike_prob=0.0))
        headers = {"Authorization": f"Bearer {tokens['ingest']}"}
        for rank in range(3):
            doc = live_batches(job, rank)[0]
            response = httpx.post(f"{server.url}/v1/ingest", json=doc, headers=headers)
            assert response.status_code == 200, response.text
        yield Served(server, tokens)


def test_capture_asks_and_captures_lists_and_downloads(served: Served, tmp_path: Path) -> None:
    url, tokens = served.server.url, served.tokens
    asked = stepscope(
        "capture", JOB, "--rank", "2", "--steps", "4", "--url", url, "--token", tokens["ingest"]
    )
    assert asked.returncode == 0, asked.stderr
    assert "rank 2 (culprit), rank 0 (reference), 4 steps" in asked.stdout
    [request] = json.loads(
        stepscope(
            "captures", JOB, "--url", url, "--token", tokens["read"], "--format", "json"
        ).stdout
    )
    by_role = {c["role"]: c for c in request["captures"]}
    assert (by_role["culprit"]["rank"], request["num_steps"]) == (2, 4)
    headers = {
        "Authorization": f"Bearer {tokens['ingest']}",
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
    }
    for role, slow_us in (("culprit", 80_000), ("reference", 2_000)):
        body = gzip.compress(json.dumps(trace(slow_us)).encode())
        response = httpx.post(
            f"{url}/v1/captures/{by_role[role]['id']}", content=body, headers=headers
        )
        assert response.status_code == 200, response.text

    listed = stepscope("captures", JOB, "--url", url, "--token", tokens["read"])
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0] == f"capture {request['id']} (user, by api), 4 steps:"
    assert f"#{by_role['culprit']['id']} rank 2 culprit: uploaded" in lines[1]
    [slow_line] = [line for line in lines if SLOW_FUNCTION in line]
    assert slow_line.split()[-3:] == ["0.0800", "0.0020", "+0.0780"]
    # The database lists the same.
    from_db = stepscope("captures", JOB, "--db", served.server.db_url)
    assert from_db.stdout == listed.stdout

    out = tmp_path / "culprit.json.gz"
    got = stepscope(
        "captures", JOB, "--download", str(by_role["culprit"]["id"]), "-o", str(out),
        "--url", url, "--token", tokens["read"],
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert json.loads(gzip.decompress(out.read_bytes())) == trace(80_000)


def test_errors_are_one_line_without_a_traceback(served: Served) -> None:
    url, tokens = served.server.url, served.tokens
    cases = [
        (("capture", JOB, "--rank", "9", "--url", url, "--token", tokens["ingest"]), 1, "rank 9"),
        (("capture", JOB, "--rank", "1", "--url", url, "--token", tokens["read"]), 1, "ingest"),
        (("capture", JOB, "--rank", "1"), 2, "--url"),
        (("captures", JOB, "--download", "999", "--url", url, "--token", tokens["read"]), 1, "999"),
        (("captures", "nope", "--url", url, "--token", tokens["read"]), 1, "nope"),
    ]
    for args, code, named in cases:
        done = stepscope(*args)
        assert done.returncode == code, (args, done.stderr)
        assert named in done.stderr
        assert "Traceback" not in done.stderr
