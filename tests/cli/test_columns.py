"""The read commands at 80 columns (COLUMNS=80), against a server on each engine: no line
longer than 80 characters, a job id whole on its line (or elided in its middle, as
stepscope.text.fit documents), headers that say what they count, a straggler's job-level
throughput and MFU drops folded on one line under it; --format json as the API serves it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.store.engine import make_engine
from stepscope.synthetic.generate import JobSpec, Straggler, generate
from stepscope.text.fit import MIN_ID_WIDTH
from tests.live_server import RunningServer, server_on
from tests.support import write_job_in_rounds

SLOW = "demo-20261201-210247"
"""A job id as `stepscope demo` names it, whose rank 5 straggles from step 200."""
SEVERITIES = ("crit", "warn", "info")
"""How the jobs table's findings column spells the severities."""
LONG = "pretrain-llama3-70b-fsdp2-tp8-pp4-20261201-210247-attempt-3"
"""An id longer than the jobs table has room for."""


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with server_on(request.param) as running:
        engine = make_engine(running.db_url)
        start_ts = time.time() - 300
        slow = JobSpec(
            job_id=SLOW,
            num_ranks=8,
            ranks_per_node=4,
            num_steps=400,
            spike_prob=0.0,
            stragglers=(Straggler(ranks=(5,), factor=1.3, cause="compute", from_step=200),),
            start_ts=start_ts,
        )
        clean = JobSpec(
            job_id=LONG, num_ranks=4, ranks_per_node=4, num_steps=120, start_ts=start_ts + 60
        )
        for spec in (slow, clean):
            for _ in write_job_in_rounds(engine, generate(spec), steps_per_batch=100):
                pass
            JobAnalyzer(engine, spec.job_id, grace_s=0).run()
        engine.dispose()
        yield running


def cli(server: RunningServer, *args: str, columns: int = 80) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    run = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", *args, "--url", server.url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "COLUMNS": str(columns)},
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def api(server: RunningServer, path: str) -> object:
    return httpx.get(f"{server.url}/api/v1{path}", timeout=60).json()


def is_the_id(cell: str, job_id: str) -> bool:
    """The cell is the id, whole or elided in its middle (its start and its end kept)."""
    if cell == job_id:
        return True
    head, _, tail = cell.partition("…")
    return (
        bool(head and tail)
        and len(cell) >= MIN_ID_WIDTH
        and job_id.startswith(head)
        and job_id.endswith(tail)
    )


@pytest.mark.parametrize("columns", [80, 60])
def test_jobs_fit_the_terminal_with_each_id_on_one_line(
    server: RunningServer, columns: int
) -> None:
    out = cli(server, "jobs", columns=columns)
    doc = json.loads(cli(server, "jobs", "--format", "json"))

    lines = out.splitlines()
    assert all(len(line) <= columns for line in lines), out
    assert lines[0].split() == ["job", "status", *lines[0].split()[2:]]
    assert "findings" in lines[0]
    assert "c/w/i" not in out
    rows = {job["job_id"]: job for job in doc["jobs"]}
    assert set(rows) == {SLOW, LONG}
    for job_id, job in rows.items():
        (line,) = [line for line in lines[2:] if is_the_id(line.split()[0], job_id)]
        numbers = (job[f"num_{s}"] for s in ("critical", "warning", "info"))
        counts = zip(numbers, SEVERITIES, strict=True)
        said = " ".join(f"{n} {s}" for n, s in counts if n) or "none"
        assert f"  {said}  " in line  # between the MFU and the start
    if columns == 80:
        assert any(line.split()[0] == SLOW for line in lines)  # whole: it fits
        assert {"MFU", "findings", "started"} <= set(lines[0].split())


def test_show_folds_the_throughput_and_mfu_drops_under_the_straggler(
    server: RunningServer,
) -> None:
    served = api(server, f"/jobs/{SLOW}/findings")
    assert isinstance(served, list)
    drops = [f for f in served if f["kind"] == "throughput_drop"]
    by_metric = {f["metric"]: f for f in drops}
    assert set(by_metric) == {"tokens_per_s", "mfu"}
    tokens, mfu = by_metric["tokens_per_s"], by_metric["mfu"]
    assert (tokens["first_step"], tokens["last_step"]) == (mfu["first_step"], mfu["last_step"])
    folded = (
        f"  └ job throughput drop steps {tokens['first_step']}-{tokens['last_step']}: "
        f"tokens/s {tokens['effect']:+.1%}, MFU {mfu['effect']:+.1%}"
    )

    for command in ("show", "findings"):
        out = cli(server, command, SLOW)
        lines = out.splitlines()
        assert all(len(line) <= 80 for line in lines), out
        [straggler] = [i for i, line in enumerate(lines) if "straggler since step 200" in line]
        assert lines[straggler].startswith("critical rank 5 (node-0001)")
        assert lines[straggler + 1] == folded
        assert not [line for line in lines if line.startswith("critical  job")]
    show = cli(server, "show", SLOW).splitlines()
    assert show[0] == f"job {SLOW} (synthetic 8x400): finished"
    assert show[-2].startswith("goodput        ")


def test_goodput_lines_fit_80_columns(server: RunningServer) -> None:
    out = cli(server, "goodput", SLOW)

    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), out
    assert lines[0].startswith("goodput        ")
    assert any(line.strip().startswith("straggler wait") for line in lines)
    assert any(line.startswith("layers: ") for line in lines)


def test_json_is_what_the_api_serves(server: RunningServer) -> None:
    findings = json.loads(cli(server, "findings", SLOW, "--format", "json"))
    goodput = json.loads(cli(server, "goodput", SLOW, "--format", "json"))
    show = json.loads(cli(server, "show", SLOW, "--format", "json"))

    assert findings == api(server, f"/jobs/{SLOW}/findings")
    assert goodput == api(server, f"/jobs/{SLOW}/goodput")
    assert show["summary"] == api(server, f"/jobs/{SLOW}")
    assert show["findings"] == findings
