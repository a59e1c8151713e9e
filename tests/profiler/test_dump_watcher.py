"""`stepscope run` ships what a rank's watchdog cannot: faulthandler's stack of a rank that
holds the GIL, and ranks that died without closing their profiler."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from stepscope.profiler.hangs.reports import dump_header
from stepscope.profiler.launch.launcher import launch
from tests.profiler.http_sink import http_sink

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
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    prof.close()
    """
)


def _run(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, Any]:
    monkeypatch.delenv("STEPSCOPE_DISABLED", raising=False)
    monkeypatch.setenv("STEPSCOPE_HANG_DUMP_DIR", str(tmp_path / "dumps"))  # not in /tmp
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    with http_sink() as sink:
        started = time.time()
        code = launch([sys.executable, str(script), mode], job_id="run-1", url=sink.url, token=None)
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
