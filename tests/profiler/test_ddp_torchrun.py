"""Real multi-process runs: torchrun + gloo + examples/ddp_train.py against a real collector."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from stepscope.schema import STEPS, busbw_bps
from tests.live_server import RunningServer, free_port, read_rows, run_server
from tests.support import require_torchrun

pytestmark = pytest.mark.torchrun

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ddp_train.py"
WIDTH = 256


def torchrun(
    nproc: int,
    *args: str,
    wait: bool = True,
    stepscope_env: dict[str, str] | None = None,
    launcher: Sequence[str] = (),
) -> Any:
    """Run (or start) the example under torchrun with only the given STEPSCOPE_* variables
    (under `launcher`, e.g. `stepscope run --`, when given)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    env.update(stepscope_env or {})
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        *launcher,
        require_torchrun(),
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(EXAMPLE),
        "--width",
        str(WIDTH),
        *args,
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out[-4000:]
    return out


def steps_by_rank(db_url: str, job_id: str) -> dict[int, list[dict[str, Any]]]:
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for row in read_rows(db_url, "steps", job_id):
        by_rank.setdefault(row["rank"], []).append(row)
    return {rank: sorted(rows, key=lambda r: r["step"]) for rank, rows in by_rank.items()}


def median(rows: list[dict[str, Any]], column: str, first_step: int = 3) -> float:
    return statistics.median(r[column] for r in rows if r["step"] >= first_step)


def model_bytes(width: int) -> int:
    """Gradient bytes of the example's MLP (three width×width layers and a 1-output head)."""
    return 4 * (3 * (width * width + width) + width + 1)


def test_every_rank_reports_every_step_and_a_data_stall_shows_in_data_s(
    live_server: RunningServer, tmp_path: Path
) -> None:
    job_id, num_steps, delay_s = "ddp-complete", 12, 0.05
    torchrun(
        3,
        *("--url", live_server.url, "--job-id", job_id, "--steps", str(num_steps)),
        *("--delay-rank", "2", "--delay-phase", "data", "--delay-s", str(delay_s)),
        *("--out", str(tmp_path)),
    )
    by_rank = steps_by_rank(live_server.db_url, job_id)
    assert sorted(by_rank) == [0, 1, 2]
    not_applicable = ("h2d_s", "flops", "mem_peak_bytes", "node", "step_rule")
    filled = [c.name for c in STEPS.columns if c.name not in not_applicable]
    for rows in by_rank.values():
        assert [r["step"] for r in rows] == list(range(num_steps))
        for row in rows:
            assert all(row[c] is not None for c in filled), row
            assert row["samples"] == 32
            assert row["tokens"] == 32 * WIDTH
            assert row["step_s"] >= row["data_s"] + row["forward_s"] + row["backward_s"]
    assert median(by_rank[2], "data_s") >= delay_s
    assert median(by_rank[0], "data_s") < delay_s / 5
    assert median(by_rank[1], "data_s") < delay_s / 5

    collectives = read_rows(live_server.db_url, "collectives", job_id)
    assert len(collectives) == 3 * num_steps
    for row in collectives:
        assert (row["op"], row["group_size"], row["count"]) == ("all_reduce", 3, 1)
        assert row["bytes"] == model_bytes(WIDTH)
        assert row["busy_s"] > 0
    [job] = read_rows(live_server.db_url, "jobs", job_id)
    assert (job["world_size"], job["device_name"]) == (3, "cpu")
    ranks = read_rows(live_server.db_url, "ranks", job_id)
    assert sorted((r["rank"], r["local_rank"]) for r in ranks) == [(0, 0), (1, 1), (2, 2)]
    sent = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [s["steps_sent"] for s in sent] == [num_steps] * 3


@pytest.mark.parametrize(
    ("phase", "comm_timing"),
    [("backward", "step"), ("forward", "step"), ("optimizer", "step"), ("backward", "bucket")],
)
def test_the_delayed_rank_waits_least_on_collectives(
    live_server: RunningServer, phase: str, comm_timing: str
) -> None:
    job_id, delay_s = f"ddp-{phase}-{comm_timing}", 0.08
    torchrun(
        2,
        *("--url", live_server.url, "--job-id", job_id, "--steps", "14"),
        *("--delay-rank", "1", "--delay-phase", phase, "--delay-s", str(delay_s)),
        stepscope_env={"STEPSCOPE_COMM_TIMING": comm_timing},
    )
    by_rank = steps_by_rank(live_server.db_url, job_id)
    slow_wait_s = median(by_rank[1], "comm_wait_s")
    peer_wait_s = median(by_rank[0], "comm_wait_s")
    assert peer_wait_s >= 0.6 * delay_s, (slow_wait_s, peer_wait_s)
    assert slow_wait_s <= 0.25 * delay_s, (slow_wait_s, peer_wait_s)
    # Step wall times are alike on both ranks: only comm_wait_s says who was slow.
    assert median(by_rank[0], "step_s") == pytest.approx(median(by_rank[1], "step_s"), rel=0.3)


def test_explicit_all_reduce_loop_gets_bytes_and_bus_bandwidth(
    live_server: RunningServer, tmp_path: Path
) -> None:
    job_id, num_steps, per_step, numel = "allreduce-loop", 10, 4, 1 << 18
    torchrun(
        3,
        *("--url", live_server.url, "--job-id", job_id, "--mode", "allreduce"),
        *("--steps", str(num_steps), "--allreduce-per-step", str(per_step)),
        *("--allreduce-numel", str(numel), "--out", str(tmp_path)),
    )
    rows = read_rows(live_server.db_url, "collectives", job_id)
    assert len(rows) == 3 * num_steps
    for row in rows:
        assert (row["op"], row["group_size"], row["count"]) == ("all_reduce", 3, per_step)
        assert row["bytes"] == per_step * numel * 4
    steps = steps_by_rank(live_server.db_url, job_id)
    for rank in range(3):
        own = json.loads((tmp_path / f"rank{rank}.json").read_text())
        mine = [r for r in rows if r["rank"] == rank]
        busy_s = sum(r["busy_s"] for r in mine)
        num_bytes = sum(r["bytes"] for r in mine)
        assert num_bytes == own["calls"] * own["bytes_per_call"]
        # The tap's span (issue to completion) lies inside the caller's (call to return).
        assert 0.5 * own["own_busy_s"] <= busy_s <= own["own_busy_s"]
        assert busbw_bps("all_reduce", 3, num_bytes, busy_s) == pytest.approx(
            num_bytes / busy_s * 2 * (3 - 1) / 3
        )
        # Synchronous collectives: the rank sat in their waits, inside the caller's span.
        wait_s = sum(r["comm_wait_s"] for r in steps[rank])
        assert wait_s == pytest.approx(sum(r["wait_s"] for r in mine), abs=1e-5)
        assert 0.5 * own["own_busy_s"] <= wait_s <= own["own_busy_s"]
        assert {r["group"] for r in mine} == {"0"}
        assert {r["group_ranks"] for r in mine} == {"0-2"}


def test_training_survives_a_collector_that_comes_up_mid_run(tmp_path: Path) -> None:
    job_id, num_steps, port = "late-collector", 60, free_port()
    proc = torchrun(
        2,
        *("--url", f"http://127.0.0.1:{port}", "--job-id", job_id, "--steps", str(num_steps)),
        *("--step-sleep-s", "0.06", "--out", str(tmp_path)),
        wait=False,
        # The job may end before a loaded machine has the server up: close() waits for it.
        stepscope_env={"STEPSCOPE_CLOSE_TIMEOUT_S": "60"},
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "rank0.started").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.5)  # training is under way and its first batches failed
        with run_server(port=port) as server:
            out, _ = proc.communicate(timeout=90)
            assert proc.returncode == 0, out[-4000:]
            by_rank = steps_by_rank(server.db_url, job_id)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "collector unreachable" in out
    assert {rank: [r["step"] for r in rows] for rank, rows in by_rank.items()} == {
        0: list(range(num_steps)),
        1: list(range(num_steps)),
    }


def test_a_profiler_bug_does_not_stop_distributed_training(
    live_server: RunningServer, tmp_path: Path
) -> None:
    job_id = "broken-ddp"
    torchrun(
        2,
        *("--url", live_server.url, "--job-id", job_id, "--steps", "8"),
        *("--break-profiler", "--out", str(tmp_path)),
    )
    for rank in range(2):
        summary = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert summary["final_loss"] > 0
    events = read_rows(live_server.db_url, "events", job_id)
    failures = sorted(e["rank"] for e in events if e["kind"] == "exception")
    assert failures == [0, 1]
    assert read_rows(live_server.db_url, "steps", job_id) == []
