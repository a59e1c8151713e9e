"""The progress watchdog: heartbeats, hang reports (stack, blocked collective, frontiers) on
/v1/hangs, no false hangs in declared phases or slow first steps, faulthandler's stacks on the
dump signal when the GIL is held."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import stepscope
from stepscope.profiler.active import ActiveProfiler
from stepscope.profiler.base import NULL_CONTEXT
from stepscope.profiler.collectives.calls import CollectiveCall
from stepscope.profiler.collectives.groups import GroupInfo, GroupRegistry
from stepscope.profiler.config import Config, build_config
from stepscope.profiler.hangs.reports import DUMP_SIGNAL, read_dump, read_last_report
from stepscope.profiler.hangs.watchdog import (
    FLOOR_S,
    LONG_S,
    STEP_MULTIPLE,
    WARMUP_STEPS,
    TrainingState,
    Watchdog,
)
from tests.profiler.http_sink import Sink, http_sink
from tests.profiler.ranks import run_ranks

HANG_AFTER_S = 1.0
HEARTBEAT_S = 0.4
REPORT_KEYS = {
    "schema",
    "job_id",
    "rank",
    "incarnation",
    "node",
    "pid",
    "world_size",
    "ts",
    "kind",
    "step",
    "section",
    "phase",
    "last_progress_ts",
    "stalled_s",
    "blocked",
    "frontiers",
    "stack",
    "stack_source",
}
FRONTIER_KEYS = {"group", "mesh_dim", "group_ranks", "size", "enqueued", "completed"}
FRAME_KEYS = {"file", "line", "function"}


def reports(sink: Sink, kind: str | None = None) -> list[dict[str, Any]]:
    """The hang reports the sink received on /v1/hangs, in order (of one kind)."""
    with sink.lock:
        bodies = list(sink.hangs)
    return [b for b in bodies if kind is None or b["kind"] == kind]


def assert_wire_shape(report: dict[str, Any]) -> None:
    assert set(report) == REPORT_KEYS
    assert report["schema"] == 1
    assert report["kind"] in ("heartbeat", "hang")
    assert isinstance(report["job_id"], str)
    assert isinstance(report["incarnation"], str)
    assert isinstance(report["node"], str)
    for key in ("rank", "pid", "world_size"):
        assert isinstance(report[key], int)
    for key in ("ts", "last_progress_ts", "stalled_s"):
        assert isinstance(report[key], float)
    assert report["last_progress_ts"] == pytest.approx(report["ts"] - report["stalled_s"], abs=0.01)
    assert report["step"] is None or isinstance(report["step"], int)
    assert report["section"] is None or isinstance(report["section"], str)
    assert report["phase"] is None or isinstance(report["phase"], str)
    blocked = report["blocked"]
    if blocked is not None:
        assert set(blocked) == {"group", "op", "seq", "since_ts", "bytes"}
    for frontier in report["frontiers"]:
        assert set(frontier) == FRONTIER_KEYS
    if report["stack"] is None:  # a heartbeat before half the threshold
        assert report["kind"] == "heartbeat"
        assert report["stack_source"] is None
    else:
        assert report["stack_source"] == "watchdog"
        assert report["stack"]
        for frame in report["stack"]:
            assert set(frame) == FRAME_KEYS
            assert isinstance(frame["line"], int)


def start(sink: Sink, **options: Any) -> ActiveProfiler:
    settings: dict[str, Any] = {"hang_after_s": HANG_AFTER_S, "heartbeat_s": HEARTBEAT_S}
    prof = stepscope.init(url=sink.url, job_id="hang-1", **{**settings, **options})
    assert isinstance(prof, ActiveProfiler)
    return prof


def warm_up(prof: stepscope.Profiler, num_steps: int = 6) -> None:
    for _ in range(num_steps):
        with prof.step(), prof.section("forward"):
            time.sleep(0.01)


def stalls_in_the_data_loader_forever(seconds: float) -> None:
    time.sleep(seconds)


def run_a_data_stall(stall_s: float, *, settle_s: float = 0.0) -> tuple[Sink, float]:
    """A job that warms up, waits `settle_s`, stalls `stall_s` in its data loader, then steps
    on and closes: the sink of its reports, and when the stall began (epoch s)."""
    with http_sink() as sink:
        prof = start(sink)
        warm_up(prof)
        time.sleep(settle_s)
        with prof.step(), prof.section("data"):
            stall_ts = time.time()
            stalls_in_the_data_loader_forever(stall_s)
        warm_up(prof, 2)
        time.sleep(HEARTBEAT_S * 2)
        prof.close()
    return sink, stall_ts


def test_heartbeats_carry_the_stack_past_half_the_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A culprit whose peers report the hang first has its stack at the server already."""
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    sink, _ = run_a_data_stall(HANG_AFTER_S * 0.9, settle_s=HEARTBEAT_S * 2)
    assert reports(sink, "hang") == []
    beats = reports(sink, "heartbeat")
    for beat in beats:
        assert_wire_shape(beat)
    half_s = HANG_AFTER_S / 2
    stalled = [b for b in beats if b["section"] == "data" and b["stalled_s"] >= half_s + 0.05]
    assert stalled, [(b["section"], b["stalled_s"]) for b in beats]
    for beat in stalled:
        assert beat["stack"][-1]["function"] == "stalls_in_the_data_loader_forever"
        assert beat["stack_source"] == "watchdog"
    assert {b["stack_source"] for b in beats if b["stalled_s"] < half_s - 0.05} == {None}


def test_a_stalled_rank_reports_its_stack_within_hang_after_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    sink, stall_ts = run_a_data_stall(HANG_AFTER_S + 2.0)
    hangs = reports(sink, "hang")
    assert hangs, "no hang report"
    first = hangs[0]
    assert_wire_shape(first)
    assert first["ts"] - stall_ts <= HANG_AFTER_S + 1.0
    assert first["stalled_s"] >= HANG_AFTER_S
    assert first["stack"][-1]["function"] == "stalls_in_the_data_loader_forever"
    assert first["stack"][-1]["file"] == __file__
    assert first["blocked"] is None
    assert first["frontiers"] == []
    assert (first["rank"], first["world_size"], first["job_id"]) == (0, 1, "hang-1")
    assert (first["step"], first["section"], first["phase"]) == (6, "data", None)
    # Repeated every heartbeat_s while the stall lasts, then a heartbeat once progress resumes.
    assert len(hangs) >= 3
    gaps_s = [b["ts"] - a["ts"] for a, b in zip(hangs, hangs[1:], strict=False)]
    assert all(HEARTBEAT_S * 0.9 <= gap <= HEARTBEAT_S + 0.5 for gap in gaps_s), gaps_s
    after = [r for r in reports(sink) if r["ts"] > hangs[-1]["ts"]]
    assert after
    assert after[0]["kind"] == "heartbeat"
    assert after[0]["stalled_s"] < HANG_AFTER_S


def test_heartbeats_arrive_every_heartbeat_s_while_training_progresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    with http_sink() as sink:
        prof = start(sink)
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            warm_up(prof, 1)
        prof.close()
    beats = reports(sink)
    assert {r["kind"] for r in beats} == {"heartbeat"}
    for beat in beats:
        assert_wire_shape(beat)
        assert beat["stalled_s"] < 0.5
    assert len(beats) >= int(2.5 / HEARTBEAT_S) - 1
    gaps_s = [b["ts"] - a["ts"] for a, b in zip(beats, beats[1:], strict=False)]
    assert all(HEARTBEAT_S * 0.9 <= gap <= HEARTBEAT_S + 0.5 for gap in gaps_s), gaps_s


def test_no_hang_during_a_declared_phase_nor_a_slow_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    with http_sink() as sink:
        prof = start(sink)
        with prof.step():  # compilation, first collectives...
            time.sleep(HANG_AFTER_S + 1.5)
        warm_up(prof)
        with prof.phase("checkpoint_save"):
            time.sleep(HANG_AFTER_S + 1.5)
        warm_up(prof, 2)
        time.sleep(HEARTBEAT_S)
        prof.close()
    all_reports = reports(sink)
    assert [r for r in all_reports if r["kind"] == "hang"] == []
    assert "checkpoint_save" in {r["phase"] for r in all_reports}
    slow_first_step = [r for r in all_reports if r["step"] == 0 and r["phase"] is None]
    assert max(r["stalled_s"] for r in slow_first_step) > HANG_AFTER_S


def _state(step: int, ended_at: float, phase: str | None = None) -> TrainingState:
    return TrainingState(
        step=step,
        first_step=0,
        ended_step=step,
        ended_at=ended_at,
        section=None,
        phase=phase,
        phase_changed_at=None,
    )


@pytest.mark.parametrize(("step_s", "expected_s"), [(0.1, FLOOR_S), (2.0, STEP_MULTIPLE * 2.0)])
def test_the_default_threshold_is_a_multiple_of_the_p99_step_time_with_a_floor(
    step_s: float, expected_s: float
) -> None:
    states: list[TrainingState] = []
    watchdog = Watchdog(
        config=Config(url="http://127.0.0.1:9"),
        identity={},
        state=lambda: states[-1],
        groups=GroupRegistry(),
        waiting=lambda: None,
        main_thread_id=0,
    )
    for step in range(4):
        states.append(_state(step, step * step_s))
        watchdog._observe(step * step_s)
    assert watchdog.hang_after_s() == LONG_S  # the first steps
    for step in range(4, 40):
        states.append(_state(step, step * step_s))
        watchdog._observe(step * step_s)
    assert watchdog.hang_after_s() == pytest.approx(expected_s)
    states.append(_state(39, 39 * step_s, phase="eval"))
    watchdog._observe(40 * step_s)
    assert watchdog.hang_after_s() == LONG_S


def test_the_p99_is_of_the_last_256_step_cycles() -> None:
    """The window slides: a run of slow steps long past counts no more."""
    states: list[TrainingState] = []
    watchdog = Watchdog(
        config=Config(url="http://127.0.0.1:9"),
        identity={},
        state=lambda: states[-1],
        groups=GroupRegistry(),
        waiting=lambda: None,
        main_thread_id=0,
    )
    cycles_s = [3.0] * 10 + [1.0 + (i % 7) / 10 for i in range(400)]
    ended_at = 0.0
    for step, cycle_s in enumerate([0.0, *cycles_s]):
        ended_at += cycle_s
        states.append(_state(step, ended_at))
        watchdog._observe(ended_at)
        window = sorted(cycles_s[max(0, step - 256) : step])
        if step >= WARMUP_STEPS:
            p99_s = window[min(len(window) - 1, int(0.99 * len(window)))]
            assert watchdog.hang_after_s() == pytest.approx(max(FLOOR_S, STEP_MULTIPLE * p99_s))
    assert watchdog.hang_after_s() == pytest.approx(STEP_MULTIPLE * 1.6)


def holds_the_gil(seconds: int) -> None:
    ctypes.PyDLL(None).sleep(seconds)  # libc's sleep, called without releasing the GIL


SEND_DUMP_SIGNAL = """
import sys, time
from stepscope.profiler.hangs.dump_watcher import signal_thread
pid, tid, signum = map(int, sys.argv[1:])
print("ready", flush=True)
time.sleep(0.5)
sys.exit(0 if signal_thread(pid, tid, signum) else 1)
"""
"""What `stepscope run` does to a rank whose watchdog went silent, from another process."""


def test_a_rank_holding_the_gil_writes_its_stacks_on_the_dump_signal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    with http_sink() as sink:
        prof = start(sink, hang_dump_dir=str(tmp_path))
        warm_up(prof)
        time.sleep(0.3)  # the watchdog sees the first steps end and shortens the threshold
        [path] = tmp_path.glob("*.txt")
        before = read_dump(path)
        last = read_last_report(path)
        assert before is not None
        assert last is not None
        assert (before.num_dumps, before.identity["dump_signal"]) == (0, DUMP_SIGNAL)
        assert last["dump_after_s"] == HANG_AFTER_S + 2.0  # and the watchdog's HTTP timeout
        args = [str(os.getpid()), str(last["watchdog_tid"]), str(DUMP_SIGNAL)]
        with subprocess.Popen(
            [sys.executable, "-c", SEND_DUMP_SIGNAL, *args], stdout=subprocess.PIPE, text=True
        ) as sender:
            assert sender.stdout is not None
            assert sender.stdout.readline().strip() == "ready"
            with prof.step():
                started = time.perf_counter()
                holds_the_gil(3)
                held_s = time.perf_counter() - started
            assert sender.wait(30) == 0
        dump = read_dump(path)
        prof.close()
    assert dump is not None
    assert dump.num_dumps == 1
    assert dump.stack is not None
    assert dump.stack[-1]["function"] == "holds_the_gil"
    assert dump.stack[-1]["file"] == __file__
    assert dump.identity["rank"] == 0
    assert dump.identity["pid"] == os.getpid()
    # The signal went to the watchdog thread: the training thread's sleep was not cut short.
    assert held_s >= 3.0
    assert read_dump(path).closed  # type: ignore[union-attr]


def test_a_dump_signal_after_the_profiler_closed_ends_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    assert DUMP_SIGNAL is not None
    with http_sink() as sink:
        prof = start(sink, hang_dump_dir=str(tmp_path))
        warm_up(prof)
        prof.close()
    # A signal `stepscope run` sent just before the close lands after it: still handled.
    os.kill(os.getpid(), DUMP_SIGNAL)
    time.sleep(0.1)
    assert list(tmp_path.iterdir()) == []


def test_a_program_that_handles_the_dump_signal_keeps_its_handler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    assert DUMP_SIGNAL is not None
    received: list[int] = []
    previous = signal.signal(DUMP_SIGNAL, lambda signum, frame: received.append(signum))
    try:
        with http_sink() as sink:
            prof = start(sink, hang_dump_dir=str(tmp_path))
            [path] = tmp_path.glob("*.txt")
            dump = read_dump(path)
            os.kill(os.getpid(), DUMP_SIGNAL)
            time.sleep(0.1)
            prof.close()
    finally:
        signal.signal(DUMP_SIGNAL, previous)
    assert dump is not None
    assert dump.identity["dump_signal"] is None  # `stepscope run` will not send it
    assert received == [DUMP_SIGNAL]


def test_a_clean_run_leaves_no_dump_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    with http_sink() as sink:
        prof = start(sink, hang_dump_dir=str(tmp_path))
        warm_up(prof)
        time.sleep(HANG_AFTER_S + 0.5)  # a stall the watchdog reports itself: no dump
        prof.close()
    assert list(tmp_path.iterdir()) == []
    assert reports(sink, "hang")


# ---- two gloo ranks: rank 1 stalls before an all_reduce ------------------------------------


def rank_1_sleeps_before_its_all_reduce(seconds: float) -> None:
    time.sleep(seconds)


def _gloo_rank(url: str, rank: int, port: int, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    os.environ.pop("STEPSCOPE_DISABLED", None)
    dist.init_process_group("gloo")
    prof = stepscope.init(
        url=url, job_id="hang-gloo", hang_after_s=HANG_AFTER_S, heartbeat_s=HEARTBEAT_S
    )
    tensor = torch.ones(4)
    stall_ts = None
    for step in range(10):
        with prof.step():
            if step == 7 and rank == 1:
                stall_ts = time.time()
                rank_1_sleeps_before_its_all_reduce(HANG_AFTER_S + 2.5)
            dist.all_reduce(tensor)
    prof.close()
    dist.destroy_process_group()
    queue.put({"rank": rank, "stall_ts": stall_ts})


def test_two_gloo_ranks_name_the_collective_and_the_culprits_stack() -> None:
    with http_sink() as sink:
        results = run_ranks(functools.partial(_gloo_rank, sink.url), 2)
    stall_ts = results[1]["stall_ts"]
    hangs = {rank: [r for r in reports(sink, "hang") if r["rank"] == rank] for rank in (0, 1)}
    waiter, culprit = hangs[0][0], hangs[1][0]
    for report in (waiter, culprit):
        assert_wire_shape(report)
        assert report["world_size"] == 2
        assert report["step"] == 7
        assert report["ts"] - stall_ts <= HANG_AFTER_S + 2.0
    # 7 all-reduces completed (steps 0-6); rank 0 sits in the 8th, rank 1 never issued it.
    assert waiter["blocked"]["op"] == "all_reduce"
    assert waiter["blocked"]["seq"] == 8
    assert waiter["blocked"]["group"] == "0"
    assert waiter["blocked"]["bytes"] == 16
    assert waiter["blocked"]["since_ts"] <= waiter["ts"] - HANG_AFTER_S + 0.2
    [frontier] = waiter["frontiers"]
    assert frontier == {
        "group": "0",
        "mesh_dim": None,
        "group_ranks": "0-1",
        "size": 2,
        "enqueued": 8,
        "completed": 7,
    }
    assert waiter["stack"][-1]["function"] == "all_reduce"  # the tap's own frames left out
    assert culprit["blocked"] is None
    assert culprit["frontiers"][0]["enqueued"] == culprit["frontiers"][0]["completed"] == 7
    assert culprit["stack"][-1]["function"] == "rank_1_sleeps_before_its_all_reduce"


# ---- configuration and fail-open --------------------------------------------------------


def test_hang_settings_come_from_stepscope_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSCOPE_HANG_AFTER_S", "7.5")
    monkeypatch.setenv("STEPSCOPE_HEARTBEAT_S", "3")
    monkeypatch.setenv("STEPSCOPE_HANG_WATCHDOG", "0")
    monkeypatch.setenv("STEPSCOPE_HANG_DUMP_DIR", "/tmp/dumps")
    config = build_config()
    assert (config.hang_after_s, config.heartbeat_s) == (7.5, 3.0)
    assert (config.hang_watchdog, config.hang_dump_dir) == (False, "/tmp/dumps")
    for bad in ({"hang_after_s": 0.0}, {"heartbeat_s": -1.0}):
        with pytest.raises(ValueError, match="must be > 0"):
            Config(**bad)


def test_a_disabled_profiler_has_a_no_op_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSCOPE_DISABLED", "1")
    prof = stepscope.init(url="http://127.0.0.1:9")
    assert prof.phase("checkpoint_save") is NULL_CONTEXT


@pytest.mark.parametrize(("hang_after_s", "poll_s"), [(1.0, 0.1), (4.0, 0.4), (600.0, 0.5)])
def test_the_watchdog_looks_every_tenth_of_its_threshold_between_0_1_and_0_5_s(
    hang_after_s: float, poll_s: float
) -> None:
    looks: list[float] = []

    def progressing() -> TrainingState:
        looks.append(time.perf_counter())
        return _state(len(looks), looks[-1])

    watchdog = Watchdog(
        config=Config(url="http://127.0.0.1:9", hang_after_s=hang_after_s, heartbeat_s=1000.0),
        identity={},
        state=progressing,
        groups=GroupRegistry(),
        waiting=lambda: None,
        main_thread_id=0,
    )
    watchdog._steps_done = WARMUP_STEPS  # past the warm-up's long threshold
    watchdog.start()
    time.sleep(1.4)
    watchdog.stop(timeout_s=2.0)
    gaps_s = [later - earlier for earlier, later in zip(looks, looks[1:], strict=False)]
    assert len(gaps_s) >= 2
    # The first look comes after 0.1 s, before the threshold is known; a wait is never shorter
    # than asked (a busy machine only makes the gaps longer).
    assert min(gaps_s[1:]) >= 0.95 * poll_s


def test_a_watchdog_error_stops_the_watchdog_once_and_training_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken_state() -> TrainingState:
        raise RuntimeError("boom")

    watchdog = Watchdog(
        config=Config(url="http://127.0.0.1:9"),
        identity={},
        state=broken_state,
        groups=GroupRegistry(),
        waiting=lambda: None,
        main_thread_id=0,
    )
    watchdog.start()
    watchdog._thread.join(2.0)
    assert not watchdog._thread.is_alive()
    errors = [r for r in caplog.records if "watchdog stopped" in r.getMessage()]
    assert len(errors) == 1


def test_a_broken_profiler_stops_its_watchdog_so_no_false_hang_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    with http_sink() as sink:
        prof = start(sink)
        warm_up(prof)
        prof._fail(RuntimeError("internal error"))
        warm_up(prof)  # no-ops now: no progress is stored
        time.sleep(HANG_AFTER_S + 0.5)
        prof.close()
    assert reports(sink, "hang") == []


def test_an_unreachable_server_never_reaches_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    prof = stepscope.init(
        url="http://127.0.0.1:9", job_id="down-1", hang_after_s=0.5, heartbeat_s=0.2
    )
    assert isinstance(prof, ActiveProfiler)
    warm_up(prof)
    time.sleep(1.0)  # heartbeats and a hang report, all refused
    started = time.monotonic()
    prof.close()
    assert time.monotonic() - started < 15
    assert prof._watchdog is not None
    assert not prof._watchdog._thread.is_alive()


def test_on_a_device_clock_the_completed_frontier_is_what_the_device_finished() -> None:
    # CUDA work's futures complete at enqueue; the end events say when the GPU is done.
    group = GroupInfo(name="0", size=2, ranks="0-1", seq=5, completed_seq=5)
    groups = GroupRegistry()
    groups.by_name["0"] = group
    calls = [
        CollectiveCall(op="all_reduce", group=group, num_bytes=4, start=0, end=end, seq=seq)
        for seq, end in ((3, "done"), (4, "done"), (5, "running"))
    ]
    watchdog = Watchdog(
        config=Config(url="http://127.0.0.1:9"),
        identity={},
        state=lambda: _state(9, 1.0),
        groups=groups,
        waiting=lambda: None,
        main_thread_id=0,
        device_calls=lambda: (calls, lambda mark: mark == "done"),
    )
    report = watchdog.report("heartbeat", _state(9, 1.0), time.perf_counter())
    assert report["frontiers"][0]["enqueued"] == 5
    assert report["frontiers"][0]["completed"] == 4
