"""Lightning under `stepscope run`, with no code change: the Trainer loads stepscope's callback
from its entry point, which marks a step per optimizer update on every rank; a rank slowed
in training_step is named the compute straggler, its peer's wait in DDP's all-reduce is
comm_wait_s. The job (tests/integrations/lightning_train.py) never imports stepscope."""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from stepscope.integrations.lightning import pytorch_lightning_callbacks
from tests.live_server import RunningServer, read_rows
from tests.profiler.test_ddp_torchrun import median, steps_by_rank
from tests.support import require, require_torchrun

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integrations" / "lightning_train.py"
MAX_STEPS = 100
STEPS_PER_EPOCH = 50
BATCH_SIZE = 32
WIDTH = 256
STEP_SLEEP_S = 0.02
"""Each training_step's stand-in for device time (lightning_train.py): steps of ~25 ms."""
DELAY_S = 0.02
"""Rank 1's extra time in training_step: its steps ~80 % longer. With two ranks on two busy
cores the test's statistic varied tenfold between runs at half this delay (11 to 144 sigmas,
and once none): the delay is what the test controls, so it leaves a margin."""
DELAY_FROM_STEP = 40
"""The analysis skips 20 warm-up steps; with two ranks (the peers' median is their mean) a
straggler shows only as a rank rising above its own level: 20 steps at that level first."""


def require_lightning() -> None:
    """pytorch_lightning must be installed (a failure under CI=true, else a skip)."""
    installed = importlib.util.find_spec("pytorch_lightning") is not None
    require(installed, "pytorch_lightning (pip install 'pytorch-lightning==2.6.6')")


def stepscope_run(server: RunningServer, job_id: str, *command: str) -> None:
    """Run `command` under `stepscope run` (only the environment it sets for stepscope)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    env["OMP_NUM_THREADS"] = "1"
    launcher = [sys.executable, "-m", "stepscope.cli", "run", "--url", server.url]
    done = subprocess.run(
        [*launcher, "--job-id", job_id, "--", *command],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-4000:]


def analyze(server: RunningServer, job_id: str) -> list[dict[str, Any]]:
    """The server's findings for the job, analysed now."""
    response = httpx.post(f"{server.url}/api/v1/jobs/{job_id}/analyze", timeout=120)
    response.raise_for_status()
    findings: list[dict[str, Any]] = response.json()
    return findings


def phases(server: RunningServer, job_id: str) -> dict[int, list[str]]:
    """rank -> names of the phases it declared, in order."""
    events = sorted(read_rows(server.db_url, "events", job_id), key=lambda e: e["ts"])
    by_rank: dict[int, list[str]] = {}
    for event in events:
        if event["kind"] == "phase":
            by_rank.setdefault(event["rank"], []).append(event["attributes"]["name"])
    return by_rank


def before_delay(rows: list[dict[str, Any]], column: str) -> float:
    return statistics.median(r[column] for r in rows if 20 <= r["step"] < DELAY_FROM_STEP)


@pytest.mark.torchrun
def test_a_rank_slow_in_training_step_is_the_compute_straggler_with_no_code_change(
    live_server: RunningServer,
) -> None:
    job_id = "lightning-ddp"
    require_lightning()
    torchrun = require_torchrun()
    stepscope_run(
        live_server,
        job_id,
        *(torchrun, "--standalone", "--nproc_per_node=2", str(SCRIPT)),
        *("--max-steps", str(MAX_STEPS), "--steps-per-epoch", str(STEPS_PER_EPOCH)),
        *("--width", str(WIDTH), "--batch-size", str(BATCH_SIZE)),
        *("--step-sleep-s", str(STEP_SLEEP_S), "--delay-rank", "1"),
        *("--delay-from-step", str(DELAY_FROM_STEP), "--delay-s", str(DELAY_S)),
    )

    by_rank = steps_by_rank(live_server.db_url, job_id)
    assert sorted(by_rank) == [0, 1]
    flops_per_batch = 6 * (2 * (WIDTH * WIDTH + WIDTH) + WIDTH + 1) * BATCH_SIZE
    for rows in by_rank.values():
        assert [r["step"] for r in rows] == list(range(MAX_STEPS))
        assert {(r["step_rule"], r["samples"], r["flops"]) for r in rows} == {
            ("lightning", BATCH_SIZE, flops_per_batch)
        }
        assert all(r["forward_s"] >= STEP_SLEEP_S for r in rows)
        assert all(r["backward_s"] > 0 and r["optimizer_s"] > 0 for r in rows)
    slow, peer = by_rank[1], by_rank[0]
    after = DELAY_FROM_STEP + 5
    # The delay is rank 1's forward and compute; its peer waits for it in DDP's all-reduce.
    assert median(slow, "forward_s", after) - before_delay(slow, "forward_s") >= 0.8 * DELAY_S
    assert median(slow, "compute_s", after) - before_delay(slow, "compute_s") >= 0.7 * DELAY_S
    assert median(peer, "compute_s", after) - before_delay(peer, "compute_s") <= 0.3 * DELAY_S
    assert median(peer, "comm_wait_s", after) >= median(slow, "comm_wait_s", after) + 0.6 * DELAY_S
    # Validation at each epoch's end is the eval phase, outside the steps.
    assert phases(live_server, job_id) == {0: ["eval", "eval"], 1: ["eval", "eval"]}

    findings = analyze(live_server, job_id)
    stragglers = [(f["kind"], f["ranks"], f["cause"]) for f in findings if f["ranks"]]
    assert ("straggler_rank", [1], "compute") in stragglers, findings
    assert not [s for s in stragglers if s[1] == [0] and s[2] == "compute"], findings


def test_accumulated_micro_batches_are_one_step_and_checkpoint_saves_are_phases(
    live_server: RunningServer, tmp_path: Path
) -> None:
    """One process (Lightning's own "auto" strategy), 3 micro-batches per optimizer update."""
    job_id, accumulate, num_steps = "lightning-accumulate", 3, 12
    require_lightning()
    stepscope_run(
        live_server,
        job_id,
        *(sys.executable, str(SCRIPT), "--devices", "1", "--max-steps", str(num_steps)),
        *("--accumulate", str(accumulate), "--steps-per-epoch", str(num_steps)),
        *("--width", str(WIDTH), "--batch-size", str(BATCH_SIZE)),
        *("--step-sleep-s", str(STEP_SLEEP_S), "--checkpoint-dir", str(tmp_path)),
    )
    [rows] = steps_by_rank(live_server.db_url, job_id).values()
    assert [r["step"] for r in rows] == list(range(num_steps))
    flops_per_batch = 6 * (2 * (WIDTH * WIDTH + WIDTH) + WIDTH + 1) * BATCH_SIZE
    for row in rows:
        assert row["samples"] == accumulate * BATCH_SIZE
        assert row["flops"] == accumulate * flops_per_batch
        assert row["forward_s"] >= accumulate * STEP_SLEEP_S
    saved = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert saved == ["epoch=0-step=10.ckpt", "epoch=0-step=5.ckpt"]
    assert phases(live_server, job_id) == {0: ["checkpoint_save", "checkpoint_save", "eval"]}


@pytest.mark.parametrize(
    ("environment", "num_callbacks"),
    [
        ({"STEPSCOPE_AUTO": "1"}, 1),
        ({"STEPSCOPE_AUTO": "0"}, 0),
        ({}, 0),
        ({"STEPSCOPE_AUTO": "1", "STEPSCOPE_DISABLED": "1"}, 0),
    ],
)
def test_the_entry_point_adds_the_callback_only_under_stepscope_run(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], num_callbacks: int
) -> None:
    require_lightning()
    import pytorch_lightning as pl

    for name in ("STEPSCOPE_AUTO", "STEPSCOPE_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    callbacks = pytorch_lightning_callbacks()
    assert len(callbacks) == num_callbacks
    assert all(isinstance(c, pl.Callback) for c in callbacks)
