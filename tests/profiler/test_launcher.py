"""launch(): the child gets the profiler's settings, our signals and gives back its exit code."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stepscope.profiler.launch.launcher import launch, new_job_id

REPO = Path(__file__).resolve().parents[2]
ENV_KEYS = ("STEPSCOPE_JOB_ID", "STEPSCOPE_URL", "STEPSCOPE_TOKEN", "STEPSCOPE_TEST_INHERITED")
DUMP_ENV = (
    "import json, os, sys; "
    f"json.dump({{k: os.environ.get(k) for k in {ENV_KEYS!r}}}, open(sys.argv[1], 'w'))"
)


def _child_env(
    tmp_path: Path, *, job_id: str | None, url: str | None, token: str | None
) -> dict[str, str | None]:
    out = tmp_path / "env.json"
    cmd = [sys.executable, "-c", DUMP_ENV, str(out)]
    assert launch(cmd, job_id=job_id, url=url, token=token) == 0
    env: dict[str, str | None] = json.loads(out.read_text())
    return env


def test_child_sees_job_url_and_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSCOPE_TEST_INHERITED", "kept")
    env = _child_env(tmp_path, job_id="llm-8b-42", url="http://collector:8000", token="s3cret")
    assert env == {
        "STEPSCOPE_JOB_ID": "llm-8b-42",
        "STEPSCOPE_URL": "http://collector:8000",
        "STEPSCOPE_TOKEN": "s3cret",
        "STEPSCOPE_TEST_INHERITED": "kept",
    }


def test_unset_url_and_token_keep_what_the_shell_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPSCOPE_URL", "http://from-shell:9000")
    monkeypatch.delenv("STEPSCOPE_TOKEN", raising=False)
    env = _child_env(tmp_path, job_id="j1", url=None, token=None)
    assert env["STEPSCOPE_URL"] == "http://from-shell:9000"
    assert env["STEPSCOPE_TOKEN"] is None


def test_a_job_id_is_generated_from_the_script_name(tmp_path: Path) -> None:
    script = tmp_path / "Train_LLM.py"
    script.write_text(DUMP_ENV)
    ids = []
    for i in range(2):
        out = tmp_path / f"env{i}.json"
        assert (
            launch([sys.executable, str(script), str(out)], job_id=None, url=None, token=None) == 0
        )
        ids.append(json.loads(out.read_text())["STEPSCOPE_JOB_ID"])
    assert all(re.fullmatch(r"train-llm-\d{8}-\d{6}-[0-9a-f]{4}", job_id) for job_id in ids), ids
    assert ids[0] != ids[1]


def test_new_job_id_without_a_script_names_the_program() -> None:
    assert re.fullmatch(r"torchrun-\d{8}-\d{6}-[0-9a-f]{4}", new_job_id(["/usr/bin/torchrun"]))
    assert re.fullmatch(r"job-\d{8}-\d{6}-[0-9a-f]{4}", new_job_id([]))


def test_exit_code_of_the_child_is_returned() -> None:
    code = "import sys; sys.exit(3)"
    assert launch([sys.executable, "-c", code], job_id="j", url=None, token=None) == 3


def test_a_child_killed_by_a_signal_gives_128_plus_n() -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    launched = launch([sys.executable, "-c", code], job_id="j", url=None, token=None)
    assert launched == 128 + signal.SIGKILL


def test_an_empty_command_is_refused() -> None:
    with pytest.raises(ValueError, match="no command"):
        launch([], job_id="j", url=None, token=None)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_to_the_launcher_reach_the_child(tmp_path: Path, signum: int) -> None:
    ready, received = tmp_path / "ready", tmp_path / "received"
    child = textwrap.dedent(
        f"""
        import pathlib, signal, sys, time
        def handle(signum, frame):
            pathlib.Path({str(received)!r}).write_text(str(signum))
            sys.exit(7)
        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        pathlib.Path({str(ready)!r}).touch()
        time.sleep(30)
        sys.exit(1)
        """
    )
    launcher = (
        "import sys; from stepscope.profiler.launch.launcher import launch; "
        "sys.exit(launch(sys.argv[1:], job_id='sig', url=None, token=None))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, sys.executable, "-c", child],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), "child did not start"
        proc.send_signal(signum)
        assert proc.wait(timeout=20) == 7
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert received.read_text() == str(int(signum))


def test_an_unknown_on_hang_action_is_refused_before_anything_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match="on_hang must be one of dump-and-exit"):
        launch(
            [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
            job_id="j",
            url=None,
            token=None,
            on_hang="reboot",
        )
    assert not marker.exists()
    usage = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "run", "--on-hang", "reboot", "--", "true"],
        capture_output=True,
        text=True,
    )
    assert usage.returncode == 2
    assert "invalid choice: 'reboot'" in usage.stderr


def test_on_hang_leaves_a_run_alone_for_a_hang_stored_before_it_began() -> None:
    """A restarted job keeps its job id: the earlier incarnation's open hang must not end it."""
    import random

    import httpx

    from stepscope.synthetic.hangs import Layout, heartbeats, inject
    from tests.collector.test_hangs import send
    from tests.live_server import run_server

    layout, now = Layout(dp=2, tp=2, pp=1), time.time()
    with run_server() as server, httpx.Client(base_url=server.url, timeout=30) as client:
        send(client, heartbeats(layout, "restarted", ts=now - 5, step=3, base_seq=10))
        hang = inject(
            layout, "restarted", "never_entered", 1, ts=now - 4, step=3, base_seq=10,
            rng=random.Random(1), hang_after_s=2.0,
        )  # fmt: skip
        send(client, hang.reports)
        deadline = time.monotonic() + 20
        while client.get("/api/v1/jobs/restarted/hang").json()["hang"] is None:
            assert time.monotonic() < deadline, "the earlier hang was not stored"
            time.sleep(0.2)
        started = time.monotonic()
        code = launch(
            [sys.executable, "-c", "import time; time.sleep(3)"],
            job_id="restarted",
            url=server.url,
            token=None,
            on_hang="dump-and-exit",
        )
    assert code == 0
    assert time.monotonic() - started >= 3.0


def test_zero_code_goes_first_on_the_pythonpath_and_keeps_the_users_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stepscope.integrations.torchtitan import HANDLER_FACTORIES
    from stepscope.profiler.launch.launcher import BOOTSTRAP_DIR, child_env

    monkeypatch.setenv("PYTHONPATH", "/opt/site:/opt/lib")
    monkeypatch.delenv("STEPSCOPE_AUTO", raising=False)
    monkeypatch.delenv("TITAN_STRUCT_LOGGER_HANDLERS", raising=False)
    env = child_env(["python", "t.py"], job_id="j", url=None, token=None)
    assert env["PYTHONPATH"] == f"{BOOTSTRAP_DIR}:/opt/site:/opt/lib"
    assert (Path(BOOTSTRAP_DIR) / "sitecustomize.py").is_file()
    assert env["STEPSCOPE_AUTO"] == "1"
    assert env["TITAN_STRUCT_LOGGER_HANDLERS"] == HANDLER_FACTORIES

    monkeypatch.setenv("TITAN_STRUCT_LOGGER_HANDLERS", "mine.factory")
    assert child_env(["t"], job_id="j", url=None, token=None)["TITAN_STRUCT_LOGGER_HANDLERS"] == (
        "mine.factory"
    )
    off = child_env(["t"], job_id="j", url=None, token=None, auto=False)
    assert (off["STEPSCOPE_AUTO"], off["PYTHONPATH"]) == ("0", "/opt/site:/opt/lib")
    monkeypatch.setenv("STEPSCOPE_AUTO", "0")
    assert child_env(["t"], job_id="j", url=None, token=None)["PYTHONPATH"] == "/opt/site:/opt/lib"
