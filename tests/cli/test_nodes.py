"""End to end through a real server: `stepscope simulate --nodes` places small jobs on three
of four hosts each, one host 10 % slow in every job; the server analyses them; `stepscope
nodes` names the slow host (from the server and from the database) and prints Slurm and
kubectl lines that parse."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.live_server import RunningServer, run_server

SLOW = "gpu-b"
JOBS = [
    ("gpu-b", "gpu-a", "gpu-c"),
    ("gpu-c", "gpu-d", "gpu-a"),
    ("gpu-c", "gpu-b", "gpu-d"),
    ("gpu-a", "gpu-c", "gpu-d"),
    ("gpu-d", "gpu-a", "gpu-b"),
    ("gpu-a", "gpu-d", "gpu-c"),
    ("gpu-d", "gpu-b", "gpu-a"),
    ("gpu-b", "gpu-c", "gpu-d"),
]
"""Three hosts per job, two ranks per host, in order: ranks 0-1 on the first, 2-3 on the
second, 4-5 on the third."""
STEP_S = 0.5
TRANSFER_S = 1e9 * (2 * 5 / 6) / 100e9
"""The simulated all-reduce of 6 ranks (JobSpec defaults): the own time is the rest."""

# scontrol(1): "scontrol update NodeName=<name> State=DRAIN Reason=<reason>"; the keywords
# are case-insensitive, a reason with spaces is quoted.
SCONTROL = re.compile(
    r'^scontrol update NodeName=([A-Za-z0-9][A-Za-z0-9._-]*) State=DRAIN Reason="[^"\n]+"$',
    re.IGNORECASE,
)
TAINT = re.compile(
    r"^[a-z0-9.-]+/[A-Za-z0-9._-]{1,63}=([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?"
    r":(NoSchedule|PreferNoSchedule|NoExecute)$"
)


def cli(*args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server() as running:
        for i, hosts in enumerate(JOBS):
            job_id = f"fleet-e2e-{i}"
            first = 2 * hosts.index(SLOW) if SLOW in hosts else 0
            slow = ["--straggler", f"{first},{first + 1}:1.1:0"] if SLOW in hosts else []
            cli(
                "simulate",
                "--url",
                running.url,
                "--job-id",
                job_id,
                "--ranks",
                "6",
                "--ranks-per-node",
                "2",
                "--nodes",
                ",".join(hosts),
                "--steps",
                "120",
                "--step-time",
                str(STEP_S),
                "--seed",
                str(i),
                *slow,
            )
            analyzed = httpx.post(f"{running.url}/api/v1/jobs/{job_id}/analyze", timeout=120)
            assert analyzed.status_code == 200, analyzed.text
        yield running


def test_nodes_names_the_slow_host_from_the_server_and_the_database(server: RunningServer) -> None:
    expected = 0.1 * STEP_S / (STEP_S - TRANSFER_S)  # its extra compute over the own time
    for source in (("--url", server.url), ("--db", server.db_url)):
        page = json.loads(cli("nodes", "--format", "json", *source))
        assert page["num_nodes"] == 4
        assert page["num_jobs"] == len(JOBS)
        [suspect] = [n for n in page["nodes"] if n["suspect"]]
        assert suspect["node"] == SLOW
        assert suspect["effect"] == pytest.approx(expected, abs=0.01)
        assert suspect["num_jobs"] == sum(SLOW in j for j in JOBS)
        assert all(abs(n["effect"]) < 0.01 for n in page["nodes"] if n["node"] != SLOW)

    detail = httpx.get(f"{server.url}/api/v1/nodes/{SLOW}").json()
    assert [g["gpu"] for g in sorted(detail["gpus"], key=lambda g: g["gpu"])] == [
        f"GPU-sim-{SLOW}-0",
        f"GPU-sim-{SLOW}-1",
    ]
    assert {f["kind"] for f in detail["findings"]} <= {"straggler_rank", "straggler_node"}
    assert detail["findings"], "the jobs' straggler findings name the slow host's ranks"

    table = cli("nodes", "--url", server.url)
    [row] = [line for line in table.splitlines() if line.strip().startswith(SLOW)]
    assert "SUSPECT" in row


def test_slurm_and_kubectl_lines_parse(server: RunningServer) -> None:
    slurm = [
        line for line in cli("nodes", "--suspect", "--format", "slurm", "--url", server.url)
        .splitlines() if not line.startswith("#")
    ]  # fmt: skip
    assert slurm[0] == f"--exclude={SLOW}"
    [drain] = slurm[1:]
    match = SCONTROL.match(drain)
    assert match is not None, drain
    assert match.group(1) == SLOW
    words = shlex.split(drain)
    assert words[:4] == ["scontrol", "update", f"NodeName={SLOW}", "State=DRAIN"]
    assert words[4].startswith("Reason=stepscope: +")

    kubectl = [
        shlex.split(line)
        for line in cli(
            "nodes", "--suspect", "--format", "kubectl", "--url", server.url
        ).splitlines()
        if not line.startswith("#")
    ]
    assert kubectl[0] == ["kubectl", "cordon", SLOW]
    assert kubectl[1][:4] == ["kubectl", "taint", "nodes", SLOW]
    assert len(kubectl[1]) == 5
    assert TAINT.match(kubectl[1][4]), kubectl[1][4]
    refused = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "nodes", "--format", "slurm", "--url", server.url],
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode == 2
    assert "--suspect" in refused.stderr
