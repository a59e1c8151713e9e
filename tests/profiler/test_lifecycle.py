"""What the profiler says of its process's life: start, resume, phases, exit (docs/goodput.md)."""

from __future__ import annotations

import os
import time

import pytest

import stepscope
from stepscope.profiler.lifecycle import detect_lifecycle, process_start_time
from tests.live_server import RunningServer, read_rows


def test_the_environment_gives_the_restart_count_and_scheduler_times() -> None:
    life = detect_lifecycle(
        {
            "TORCHELASTIC_RESTART_COUNT": "2",
            "SLURM_RESTART_COUNT": "5",
            "STEPSCOPE_SUBMITTED_AT": "1700000000.5",
            "SLURM_JOB_START_TIME": "1700000100",
        }
    )
    assert life.restart_count == 2  # torchrun's, before Slurm's requeues
    assert (life.submitted_at, life.scheduled_at) == (1700000000.5, 1700000100.0)
    slurm = detect_lifecycle({"SLURM_RESTART_COUNT": "1", "STEPSCOPE_SUBMITTED_AT": "soon"})
    assert (slurm.restart_count, slurm.submitted_at, slurm.scheduled_at) == (1, None, None)


def test_the_process_start_time_is_the_operating_systems() -> None:
    started = process_start_time()
    assert started is not None
    assert started <= time.time()
    # /proc says when this pid started; the clock tick bounds its precision.
    assert process_start_time(os.getpid()) == pytest.approx(started, abs=0.02)


def test_start_resume_phases_and_exit_are_shipped(
    live_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("STEPSCOPE_SUBMITTED_AT", "1700000000")
    before = time.time()
    with stepscope.init(job_id="lifecycle-1", url=live_server.url, hang_watchdog=False) as prof:
        with prof.phase("checkpoint_load"):
            time.sleep(0.05)
        prof.resumed_from(40)
        for step in range(40, 43):
            with prof.step(step):
                time.sleep(0.01)
        with prof.phase("eval"), prof.phase("inner"):  # a nested phase counts once
            time.sleep(0.03)
    events = {e["kind"]: e for e in read_rows(live_server.db_url, "events", "lifecycle-1")}
    start, resume, exit_ = events["start"], events["resume"], events["exit"]
    incarnation = start["attributes"]["incarnation"]
    assert start["ts"] == pytest.approx(process_start_time(), abs=0.02)
    assert start["attributes"]["restart_count"] == 1
    assert start["attributes"]["submitted_at"] == 1700000000.0
    assert start["attributes"]["init_at"] >= before
    assert resume["attributes"] == {"incarnation": incarnation, "step": 40, "resumed_from": 40}
    [first_step] = [
        r for r in read_rows(live_server.db_url, "steps", "lifecycle-1") if r["step"] == 40
    ]
    assert resume["ts"] == pytest.approx(first_step["ts"], abs=1e-3)
    phases = [
        e for e in read_rows(live_server.db_url, "events", "lifecycle-1") if e["kind"] == "phase"
    ]
    assert sorted(p["attributes"]["name"] for p in phases) == ["checkpoint_load", "eval"]
    for phase in phases:
        assert phase["attributes"]["incarnation"] == incarnation
        assert phase["attributes"]["duration_s"] >= 0.03
    assert exit_["attributes"] == {"incarnation": incarnation, "failed": 0}
    assert exit_["ts"] >= max(p["ts"] + p["attributes"]["duration_s"] for p in phases)


def test_an_exception_names_the_step_it_interrupted(live_server: RunningServer) -> None:
    with pytest.raises(RuntimeError):  # noqa: PT012 (the with-blocks are the subject)
        with stepscope.init(job_id="lifecycle-2", url=live_server.url) as prof:
            for step in range(3):
                with prof.step():
                    if step == 2:
                        raise RuntimeError("injected")
    events = {e["kind"]: e for e in read_rows(live_server.db_url, "events", "lifecycle-2")}
    assert events["exception"]["attributes"]["step"] == 2
    assert events["exit"]["attributes"]["failed"] == 1
