"""`stepscope demo --once` end to end: the real torchrun job with its injected trouble, what
the demo prints about it, and what the server then answers about the same database."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from stepscope.demo import extras
from stepscope.demo.job import TrainPlan
from stepscope.synthetic.fleet import slow_node_names
from tests.live_server import ServerProcess, free_port
from tests.support import require_torchrun

pytestmark = pytest.mark.torchrun

PLAN = TrainPlan()
_STRAGGLER_LINE = re.compile(r"\brank (\d+) \(.*\)\s+straggler .*?\b(compute|data|communication)\b")


def _straggler_lines(stdout: str) -> set[tuple[int, str]]:
    """(rank, cause) of each straggler line the demo printed about its real job."""
    real_job = stdout.split("What stepscope found", 1)[1].split("loaded ", 1)[0]
    return {
        (int(m[1]), m[2]) for line in real_job.splitlines() if (m := _STRAGGLER_LINE.search(line))
    }


@pytest.mark.timeout(900)
def test_the_demo_names_the_injected_trouble_of_a_real_job(tmp_path: Path) -> None:
    require_torchrun()
    db_url = f"sqlite:///{tmp_path / 'demo.db'}"
    run = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "demo", "--once"]
        + ["--port", str(free_port()), "--db", db_url],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=840,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    out = run.stdout

    # What it printed: the two stragglers with their causes and nobody else; the restart.
    assert _straggler_lines(out) == {(PLAN.data_rank, "data"), (PLAN.backward_rank, "compute")}
    [data_line] = [line for line in out.splitlines() if f"rank {PLAN.data_rank} (" in line]
    assert re.search(r"data \+\d+ ms/step", data_line)  # seconds per step: peers wait ~0
    assert f"rank {PLAN.crash_rank} raised in step {PLAN.crash_step}" in out
    lost_first, lost_last = PLAN.resume_step, PLAN.crash_step - 1
    assert (
        f"resumed at step {PLAN.resume_step}: steps {lost_first}-{lost_last} lost "
        f"({lost_last - lost_first + 1} steps)" in out
    )
    assert re.search(r"goodput\s+\d+\.\d% of \d+ GPU-s", out)
    assert "1,024 ranks x 100 steps" in out
    made_slow = re.search(r"loaded a synthetic fleet: .*, (\d+) of them made slow", out)
    suspected = re.search(r"fleet health \(.*\): (\d+) suspect node\(s\)", out)
    assert made_slow is not None, out[-2000:]
    assert suspected is not None, out[-2000:]
    dashboard = re.search(r"Dashboard: http://127\.0\.0\.1:\d+/jobs/(demo-[\d-]+)\n", out)
    assert dashboard is not None
    job_id = dashboard[1]

    # What the server answers about the same database.
    with (
        ServerProcess(db_url, log_path=tmp_path / "server.log") as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        listed = client.get("/api/v1/jobs", params={"limit": 200}).json()["jobs"]
        by_id = {j["job_id"]: j for j in listed}
        job = by_id[job_id]
        assert (job["status"], job["world_size"]) == ("finished", PLAN.num_ranks)
        assert by_id[f"{job_id}-synthetic-1024"]["world_size"] == 1024
        assert sum(j.startswith("demo-fleet-") for j in by_id) == 40
        assert len(by_id) == 42  # and nothing else

        # The fleet the demo said it loaded is the one fleet health (the Fleet page) shows.
        suspects = client.get("/api/v1/nodes", params={"suspect": True}).json()
        num_slow = len(extras.FLEET.slow_nodes)
        assert int(made_slow[1]) == int(suspected[1]) == suspects["num_suspects"] == num_slow
        assert {n["node"] for n in suspects["nodes"]} == set(slow_node_names(extras.FLEET))

        findings = client.get(f"/api/v1/jobs/{job_id}/findings").json()
        slow = {
            (tuple(f["ranks"]), f["cause"]): f
            for f in findings
            if f["kind"] in ("straggler_rank", "straggler_node", "gpu_throttling")
        }
        assert set(slow) == {((PLAN.data_rank,), "data"), ((PLAN.backward_rank,), "compute")}
        data = slow[(PLAN.data_rank,), "data"]
        first, last = PLAN.data_steps
        assert abs(data["first_step"] - first) <= 3
        assert data["last_step"] is not None
        assert abs(data["last_step"] - last) <= 3
        assert data["evidence"]["rank_median_s"] == pytest.approx(PLAN.data_s, rel=0.3)
        backward = slow[(PLAN.backward_rank,), "compute"]
        assert abs(backward["first_step"] - PLAN.backward_from_step) <= 3
        assert backward["last_step"] is None  # slow to the end
        excess_s = backward["evidence"]["rank_median_s"] - backward["evidence"]["peers_median_s"]
        assert excess_s == pytest.approx(PLAN.backward_s, rel=0.3)

        goodput = client.get(f"/api/v1/jobs/{job_id}/goodput").json()
        first_run, second_run = goodput["incarnations"]
        assert first_run["lost_steps"] == [PLAN.resume_step, PLAN.crash_step - 1]
        assert first_run["resumed_at"] == PLAN.resume_step
        assert first_run["failure"]["rank"] == PLAN.crash_rank
        assert "injected failure" in first_run["failure"]["message"]
        assert (second_run["first_step"], second_run["last_step"]) == (
            PLAN.resume_step,
            PLAN.num_steps - 1,
        )
        assert second_run["failure"] is None
        assert goodput["categories"]["checkpoint_save"]["gpu_s"] > 0
        assert goodput["categories"]["checkpoint_load"]["gpu_s"] > 0


def test_without_torch_the_demo_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from stepscope.cli.app import app

    monkeypatch.setitem(sys.modules, "torch", None)  # find_spec("torch") is then None
    result = CliRunner().invoke(app, ["demo", "--once", "--port", str(free_port())])
    assert result.exit_code == 2
    assert "needs PyTorch: pip install 'stepscope[torch,server]'" in " ".join(result.output.split())
