"""A real torchrun job restarted after a failure: what its goodput says (docs/goodput.md).

4 gloo ranks, `--max-restarts 1`, a checkpoint every 20 steps, rank 2 raising in step 50:
the second incarnation resumes from the checkpoint of step 40.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.live_server import RunningServer, read_rows
from tests.support import require_torchrun

pytestmark = pytest.mark.torchrun

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "restart_train.py"
JOB = "restart-goodput"
NPROC = 4


def test_a_restart_from_a_checkpoint_loses_exactly_the_steps_since_it(
    live_server: RunningServer, tmp_path: Path
) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    ckpt.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPSCOPE_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        require_torchrun(),
        "--standalone",
        f"--nproc_per_node={NPROC}",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        str(EXAMPLE),
        *("--url", live_server.url, "--job-id", JOB, "--steps", "70"),
        *("--ckpt-every", "20", "--ckpt-dir", str(ckpt), "--out", str(out)),
        *("--fail-rank", "2", "--fail-step", "50"),
    ]
    run = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    with httpx.Client(base_url=live_server.url, timeout=60) as client:
        assert client.post(f"/api/v1/jobs/{JOB}/analyze").status_code == 200
        doc = client.get(f"/api/v1/jobs/{JOB}/goodput").json()
    first, second = doc["incarnations"]
    assert first["lost_steps"] == [40, 49]
    assert first["interrupted_step"] == 50
    assert first["resumed_at"] == 40
    assert (second["first_step"], second["last_step"]) == (40, 69)
    assert first["failure"]["rank"] == 2
    assert "RuntimeError: injected failure at step 50" in first["failure"]["message"]
    assert doc["responsible"]["lost_progress"][0]["ranks"] == [2]

    # Restart downtime: from the first incarnation's last moment alive to each new process.
    ends = [json.loads(p.read_text())["ts"] for p in out.glob("end-0-*.json")]
    starts = [json.loads((out / f"start-1-{r}.json").read_text()) for r in range(NPROC)]
    measured_gap_s = sum(s["started_at"] - max(ends) for s in starts)
    downtime_gpu_s = doc["categories"]["restart_downtime"]["gpu_s"]
    assert downtime_gpu_s / NPROC == pytest.approx(measured_gap_s / NPROC, abs=1.0)

    # Checkpoints: saves at 20 and 40, then 60 after the restart; one load; on every rank.
    events = read_rows(live_server.db_url, "events", JOB)
    phases = [e for e in events if e["kind"] == "phase"]
    names = sorted(e["attributes"]["name"] for e in phases)
    assert names == ["checkpoint_load"] * NPROC + ["checkpoint_save"] * 3 * NPROC
    for name in ("checkpoint_save", "checkpoint_load"):
        stored_s = sum(
            e["attributes"]["duration_s"] for e in phases if e["attributes"]["name"] == name
        )
        assert doc["categories"][name]["gpu_s"] == pytest.approx(stored_s, rel=1e-9)
    total = sum(c["gpu_s"] for c in doc["categories"].values())
    assert total == pytest.approx(doc["total_gpu_s"], rel=1e-9)
