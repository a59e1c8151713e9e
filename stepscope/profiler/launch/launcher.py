"""`stepscope run -- CMD`: run a training command with the profiler settings in its environment."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from stepscope.profiler.config import parse_bool
from stepscope.profiler.hangs.action import ON_HANG_ACTIONS, HangAction
from stepscope.profiler.hangs.dump_watcher import DumpWatcher
from stepscope.profiler.shipping.node_relay import NodeRelay

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def new_job_id(cmd: Sequence[str] = ()) -> str:
    """A short, readable, unique job id: script name, start time and 4 random hex digits."""
    script = next((arg for arg in cmd if arg.endswith(".py")), cmd[0] if cmd else "job")
    name = re.sub(r"[^a-z0-9]+", "-", Path(script).stem.lower()).strip("-")[:24] or "job"
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


BOOTSTRAP_DIR = str(Path(__file__).resolve().parents[1] / "auto" / "bootstrap")
"""The folder of zero-code's sitecustomize.py, first on the command's PYTHONPATH."""


TORCHTITAN_HANDLERS = (
    "torchtitan.observability.structured_logger.jsonl_handler.register_jsonl_handler,"
    "stepscope.integrations.torchtitan.register_handler"
)
"""torchtitan's own JSONL handler factory and stepscope's (the variable replaces its default)."""


def child_env(
    cmd: Sequence[str],
    *,
    job_id: str | None,
    url: str | None,
    token: str | None,
    auto: bool = True,
) -> dict[str, str]:
    """This process's environment plus STEPSCOPE_JOB_ID/URL/TOKEN (None keeps what is inherited)
    and, with `auto` (unless STEPSCOPE_AUTO=0 is inherited), zero-code's bootstrap."""
    env = dict(os.environ)
    env["STEPSCOPE_JOB_ID"] = job_id or new_job_id(cmd)
    if url is not None:
        env["STEPSCOPE_URL"] = url
    if token is not None:
        env["STEPSCOPE_TOKEN"] = token
    if env.get("STEPSCOPE_AUTO", "").strip().lower() in ("0", "false", "no", "off"):
        auto = False
    env["STEPSCOPE_AUTO"] = "1" if auto else "0"
    if auto:
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *paths])
        env.setdefault("TITAN_STRUCT_LOGGER_HANDLERS", TORCHTITAN_HANDLERS)
    return env


def launch(
    cmd: Sequence[str],
    *,
    job_id: str | None,
    url: str | None,
    token: str | None,
    on_hang: str | None = None,
    node_relay: bool = True,
    auto: bool = True,
) -> int:
    """Run `cmd` with the profiler's settings, forwarding SIGINT/SIGTERM; return its exit code.

    A child killed by signal N gives 128 + N, as a shell reports it. With
    `on_hang="dump-and-exit"`, a hang the server confirms ends the command after the ranks
    dumped their flight recorders (hangs/action.py); the exit code is then never 0. With
    `auto`, a script that never calls stepscope is profiled all the same (profiler/auto).
    With `node_relay`, the node's ranks send their batches through one
    NodeRelay (shipping/node_relay.py).
    """
    if not cmd:
        raise ValueError(
            "no command to run: pass it after `--`, e.g. stepscope run -- torchrun ..."
        )
    if on_hang is not None and on_hang not in ON_HANG_ACTIONS:
        raise ValueError(f"on_hang must be one of {', '.join(ON_HANG_ACTIONS)}, got {on_hang!r}")
    env = child_env(cmd, job_id=job_id, url=url, token=token, auto=auto)
    watcher = _start_dump_watcher(env)
    relay = _start_node_relay(env) if node_relay else None
    child = subprocess.Popen(list(cmd), env=env)
    if watcher is not None:
        watcher.children.add(child.pid)
    action = None
    if on_hang is not None and env.get("STEPSCOPE_URL"):
        action = HangAction(
            child,
            url=env["STEPSCOPE_URL"],
            job_id=env["STEPSCOPE_JOB_ID"],
            token=env.get("STEPSCOPE_TOKEN"),
            dump_dir=watcher.dump_dir if watcher is not None else None,
        )
        action.start()

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and _terminal_sent_it_to_the_child_too():
            return
        if child.poll() is None:
            child.send_signal(signum)

    previous = {}
    try:
        for signum in _FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, forward)
    except ValueError:
        pass  # not the main thread: signals cannot be caught here, the child still gets Ctrl-C
    try:
        returncode = child.wait()
    finally:
        if action is not None:
            action.stop()
        if relay is not None:
            relay.stop()
            stats = relay.stats
            sys.stderr.write(
                f"stepscope: the node relay sent {stats.num_batches} batches of this node's "
                f"ranks in {stats.num_requests} requests\n"
            )
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if watcher is not None:
            watcher.exit_codes[child.pid] = child.returncode
            watcher.stop()
            if watcher.owns_dir:
                _remove_if_empty(watcher.dump_dir)
    code = 128 - returncode if returncode < 0 else returncode
    if action is not None and action.fired_at is not None and code == 0:
        return 1  # ended for a hang: the scheduler must not take it for a finished job
    return code


def _profiling(env: dict[str, str]) -> bool:
    return bool(env.get("STEPSCOPE_URL")) and not parse_bool(env.get("STEPSCOPE_DISABLED", ""))


def _start_node_relay(env: dict[str, str]) -> NodeRelay | None:
    """Bundle the node's batches (STEPSCOPE_RELAY_URL); None without a collector URL, or
    when the ranks are told another relay."""
    if not _profiling(env) or env.get("STEPSCOPE_RELAY_URL"):
        return None
    relay = NodeRelay(env["STEPSCOPE_URL"])
    relay.start()
    env["STEPSCOPE_RELAY_URL"] = relay.url
    return relay


def _start_dump_watcher(env: dict[str, str]) -> DumpWatcher | None:
    """Give the ranks a directory for their faulthandler dumps, signal the ranks whose
    watchdog went silent (never a stopped one) and ship what lands there as hang reports
    (ranks holding the GIL, ranks that died); None without a collector URL."""
    if not _profiling(env):
        return None
    if env.get("STEPSCOPE_HANG_WATCHDOG", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    owns_dir = not env.get("STEPSCOPE_HANG_DUMP_DIR")
    if owns_dir:
        env["STEPSCOPE_HANG_DUMP_DIR"] = tempfile.mkdtemp(prefix="stepscope-hangs-")
    watcher = DumpWatcher(
        dump_dir=Path(env["STEPSCOPE_HANG_DUMP_DIR"]),
        url=env["STEPSCOPE_URL"],
        token=env.get("STEPSCOPE_TOKEN"),
    )
    watcher.owns_dir = owns_dir
    watcher.start()
    return watcher


def _remove_if_empty(directory: Path) -> None:
    """Remove the dump directory `stepscope run` made, unless a rank left a dump in it."""
    try:
        directory.rmdir()
    except OSError:
        sys.stderr.write(f"stepscope: the ranks' stack dumps are kept in {directory}\n")


def _terminal_sent_it_to_the_child_too() -> bool:
    """Whether a SIGINT came from Ctrl-C on our terminal, which signals the child as well.

    The child shares our process group, so a terminal's Ctrl-C already reached it; a second
    SIGINT would make torchrun abandon its graceful shutdown.
    """
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False
