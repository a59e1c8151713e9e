"""`stepscope run` ships what a rank's watchdog cannot: faulthandler's stack of a rank that
holds the GIL (signalled once its watchdog went silent, never while it is stopped), and ranks
that died without closing their profiler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepscope.profiler.hangs.dump_watcher import MAX_POLL_GAP_S, DumpWatcher, is_stopped
from stepscope.profiler.hangs.reports import dump_header
from stepscope.profiler.launch.launcher import launch
from tests.profiler.http_sink import Sink, http_sink

TRAIN = textwrap.dedent(
    """
    import ctypes, os, signal, sys, time
    import stepscope

    def holds_the_gil(seconds):
        ctypes.PyDLL(None).sleep(seconds)

    prof = stepscope.init(hang_after_s=1.0, heartbeat_s=0.3)
    for _ in range(6):
        with prof.step():
            time.sleep(0.01)
    time.sleep(0.5)
    with prof.step():
        if sys.argv[1] == "gil":
            holds_the_gil(4)
        elif sys.argv[1] == "stop":
            with open(sys.argv[2], "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # the test sends SIGCONT
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(3):
        with prof.step():
            time.sleep(0.01)
    prof.close()
    print("steps done", flush=True)
    """
)
STOPPED_S = 6.0
"""How long the test keeps a rank stopped: twice the silence after which a running rank is
signalled (hang_after_s 1 s and the watchdog's 2 s HTTP timeout)."""


def _run(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, Any]:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    monkeypatch.setenv("STEPSCOPE_HANG_DUMP_DIR", str(tmp_path / "dumps"))  # not in /tmp
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    with http_sink() as sink:
        started = time.time()
        code = launch(
            [sys.executable, str(script), mode, *args], job_id="run-1", url=sink.url, token=None
        )
    return code, (started, sink)


def test_a_rank_holding_the_gil_is_reported_with_faulthandlers_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, (_, sink) = _run(tmp_path, "gil", monkeypatch)
    assert code == 0
    from_dumps = [r for r in sink.hangs if r["stack_source"] == "faulthandler"]
    assert from_dumps, [r["kind"] for r in sink.hangs]
    report = from_dumps[0]
    assert report["kind"] == "hang"
    assert report["stack"][-1]["function"] == "holds_the_gil"
    assert report["stack"][-1]["file"].endswith("train.py")
    assert (report["job_id"], report["rank"]) == ("run-1", 0)
    assert report["step"] in (5, 6)  # from the watchdog's last report before the hold
    assert report["stalled_s"] >= 1.0
    watchdog_reports = [r for r in sink.hangs if r["stack_source"] != "faulthandler"]
    assert {r["incarnation"] for r in watchdog_reports} == {report["incarnation"]}
    assert report["ts"] < max(r["ts"] for r in watchdog_reports)  # shipped during the hold


def test_a_rank_that_died_is_reported_with_its_last_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    code, (_, sink) = _run(tmp_path, "kill", monkeypatch)
    assert code == 128 + 9
    [died] = [r for r in sink.hangs if r["kind"] == "hang"]
    assert died["stack"] is None
    assert died["stack_source"] is None
    assert died["rank"] == 0
    assert died["step"] in (5, 6)
    err = capfd.readouterr().err
    assert "rank 0 (pid" in err
    assert "exit status -9" in err


def test_files_left_by_an_earlier_run_are_not_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = tmp_path / "dumps" / "stepscope-old-rank0-1.txt"
    old.parent.mkdir()
    old.write_text(dump_header({"job_id": "old", "rank": 0, "pid": 999_999}, 1))
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setenv("STEPSCOPE_HANG_DUMP_DIR", str(old.parent))
    with http_sink() as sink:
        assert launch([sys.executable, "-c", "pass"], job_id="j", url=sink.url, token=None) == 0
    assert sink.hangs == []


def _resume_after(pid_file: Path, stopped_s: float) -> dict[str, float]:
    """Once the process whose pid lands in `pid_file` is stopped, send it SIGCONT
    `stopped_s` later (from a thread); when it stopped and resumed (epoch s)."""
    marks: dict[str, float] = {}

    def resume() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                pid = int(pid_file.read_text())
            except (OSError, ValueError):
                pid = 0
            if pid and is_stopped(pid):
                marks["stopped"] = time.time()
                time.sleep(stopped_s)
                marks["resumed"] = time.time()
                os.kill(pid, signal.SIGCONT)
                return
            time.sleep(0.05)

    threading.Thread(target=resume, daemon=True).start()
    return marks


def test_a_stopped_rank_is_not_signalled_and_goes_on_when_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    pid_file = tmp_path / "pid"
    marks = _resume_after(pid_file, STOPPED_S)
    code, (_, sink) = _run(tmp_path, "stop", monkeypatch, str(pid_file))
    assert code == 0
    assert marks["resumed"] - marks["stopped"] == pytest.approx(STOPPED_S, abs=0.5)
    assert "steps done" in capfd.readouterr().out
    # Never signalled, nor dumped on its own when it resumed: no stacks written or shipped.
    assert _dumped(sink) == []
    assert list((tmp_path / "dumps").iterdir()) == []


FAKE_RANK = textwrap.dedent(
    """
    import faulthandler, sys, threading, time
    from pathlib import Path
    from stepscope.profiler.hangs.reports import DUMP_SIGNAL, dump_header, write_last_report

    path = Path(sys.argv[1])
    file = path.open("w")
    faulthandler.register(DUMP_SIGNAL, file=file, all_threads=True)
    identity = {"job_id": "fake", "rank": 0, "pid": __import__("os").getpid()}
    file.write(dump_header(identity, threading.main_thread().ident, dump_signal=DUMP_SIGNAL))
    file.flush()
    # One report, then silence (as a watchdog that cannot get the GIL).
    report = {"ts": time.time(), "kind": "heartbeat", "step": 3, "last_progress_ts": time.time()}
    write_last_report(path, report, watchdog_tid=threading.get_native_id(), dump_after_s=1.0)

    def waits():
        time.sleep(120)

    print("ready", flush=True)
    waits()
    """
)
"""A rank whose watchdog reported once and then went silent for good (dump_after_s 1 s)."""


@pytest.fixture
def fake_rank(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    path = tmp_path / "stepscope-fake-rank0-1.txt"
    with subprocess.Popen(
        [sys.executable, "-c", FAKE_RANK, str(path)], stdout=subprocess.PIPE, text=True
    ) as rank:
        assert rank.stdout is not None
        assert rank.stdout.readline().strip() == "ready"
        try:
            yield rank, path
        finally:
            rank.kill()


def _dumped(sink: Sink) -> list[dict[str, Any]]:
    return [r for r in sink.hangs if r["stack_source"] == "faulthandler"]


def test_a_silent_rank_is_signalled_only_after_being_seen_running_that_long(
    tmp_path: Path, fake_rank: tuple[subprocess.Popen[str], Path]
) -> None:
    rank, _ = fake_rank
    with http_sink() as sink:
        watcher = DumpWatcher(dump_dir=tmp_path, url=sink.url, token=None)
        # Silent and stopped: never signalled, however long.
        os.kill(rank.pid, signal.SIGSTOP)
        while not is_stopped(rank.pid):
            time.sleep(0.01)
        watcher.poll()
        time.sleep(1.5)
        watcher.poll()
        assert watcher.num_signals == 0
        # Resumed: its silence counts from the last look that saw it stopped.
        os.kill(rank.pid, signal.SIGCONT)
        watcher.poll()
        assert watcher.num_signals == 0
        # This process stopped too (no look for a while): the silence counts from now on.
        time.sleep(MAX_POLL_GAP_S + 0.5)
        watcher.poll()
        assert watcher.num_signals == 0
        time.sleep(1.2)
        watcher.poll()
        assert watcher.num_signals == 1
    [report] = _dumped(sink)
    assert (report["job_id"], report["rank"], report["kind"]) == ("fake", 0, "hang")
    assert report["step"] == 3  # from its last report
    assert report["stack"][-1]["function"] == "waits"
