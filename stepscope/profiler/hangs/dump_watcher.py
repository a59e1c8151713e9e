"""`stepscope run`'s side of hang reporting: the ranks whose watchdog cannot speak.

A rank that holds the GIL cannot run its watchdog thread, and its reports stop. This thread,
in the process that wraps a node's ranks, sees that silence in the last report each watchdog
keeps next to its dump file and, unless the rank is stopped (SIGSTOP, a scheduler's suspend, a
frozen cgroup), sends the watchdog thread the dump signal: faulthandler's handler writes
every thread's stack to the rank's dump file (stepscope.profiler.hangs.watchdog). A rank that
died (killed, crashed) leaves its dump file behind, unclosed. This thread ships both as
`hang` reports with stack_source "faulthandler", built on the last report the rank's
watchdog sent (its step, section and frontiers). Stdlib only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepscope.profiler.hangs.reports import (
    HANG_SCHEMA_VERSION,
    Dump,
    hangs_endpoint,
    post_report,
    read_dump,
    read_last_report,
)
from stepscope.profiler.shipping.transport import Poster

log = logging.getLogger(__name__)

POLL_S = 0.5
MAX_POLL_GAP_S = 4 * POLL_S
"""A longer gap between two looks means this process was stopped or starved too (a job
suspended whole, a frozen container): a rank's silence is counted again from then on."""
DUMP_WAIT_S = 1.0
"""How long a signalled rank gets to write its stacks before the next look."""
_HTTP_TIMEOUT_S = 2.0


@dataclass(slots=True)
class _Seen:
    size: int = -1
    num_dumps: int = 0
    died: bool = False
    closed: bool = False
    pid: int = 0
    dump_signal: int | None = None
    watched_since: float = field(default_factory=time.time)
    """Since when this thread has seen the rank run without a break (epoch s)."""
    signalled_at: float | None = None


class DumpWatcher:
    """Polls a directory of per-rank dump files: signals the ranks whose watchdog went silent
    and reports what they dump, and the ranks that died."""

    def __init__(self, *, dump_dir: Path, url: str, token: str | None) -> None:
        self.dump_dir = dump_dir
        self._poster = Poster(hangs_endpoint(url), timeout_s=_HTTP_TIMEOUT_S)
        self._token = token
        self._seen: dict[Path, _Seen] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepscope-dumps", daemon=True)
        self.exit_codes: dict[int, int] = {}
        """Exit statuses of ranks that are this process's own children, by pid."""
        self.children: set[int] = set()
        """Pids whose exit status the launcher will put in `exit_codes` once it has reaped
        them: their death is reported only then, with the status."""
        self.num_reports = 0
        self.num_signals = 0
        """Dump signals sent (for tests)."""
        self._started_at = time.time()
        self._last_look = time.monotonic()
        self.owns_dir = False
        """The directory was made for this run (removed at the end when empty)."""

    def start(self) -> None:
        self._started_at = time.time()
        self._last_look = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stop polling, after a last look (ranks that died at the end are reported)."""
        self._stop.set()
        self._thread.join(POLL_S + DUMP_WAIT_S + 2 * _HTTP_TIMEOUT_S + 1.0)
        try:
            self.poll(signal_silent=False)
        except Exception:
            log.exception("stepscope: could not read the ranks' dump files")

    def _run(self) -> None:
        try:
            while not self._stop.wait(POLL_S):
                self.poll()
        except Exception:
            log.exception("stepscope: stopped watching the ranks' dump files after an error")

    def poll(self, *, signal_silent: bool = True) -> None:
        """Report new faulthandler dumps and ranks that died without closing their file;
        signal the ranks that went silent (with `signal_silent`)."""
        now, look = time.time(), time.monotonic()
        after_a_gap = look - self._last_look > MAX_POLL_GAP_S
        self._last_look = look
        for path in sorted(self.dump_dir.glob("stepscope-*.txt")):
            try:
                stat = path.stat()
            except OSError:  # closed and removed by its rank
                continue
            seen = self._seen.get(path)
            if seen is None:
                # A file from an earlier run in a directory the user gave is not ours to report.
                seen = self._seen[path] = _Seen(died=stat.st_mtime < self._started_at - 1.0)
            if seen.died:
                continue
            if after_a_gap:
                seen.watched_since = now
            self._look(path, stat.st_size, seen)
            if seen.closed:
                continue
            if signal_silent and self._signal_if_silent(path, seen, now):
                self._wait_for_dump(path, seen.size)
                self._look(path, -1, seen)
            if not _alive(seen.pid) and (
                seen.pid not in self.children or seen.pid in self.exit_codes
            ):
                seen.died = True
                dump = read_dump(path)
                if dump is not None and not dump.closed:
                    self._died(path, dump, seen)

    def _look(self, path: Path, size: int, seen: _Seen) -> None:
        """Read the file when it changed (`size` -1: whatever its size) and report a new dump."""
        if size == seen.size:
            return
        dump = read_dump(path)
        seen.size = size if size >= 0 else _size(path)
        if dump is None:
            return
        seen.pid = int(dump.identity.get("pid") or 0)
        signum = dump.identity.get("dump_signal")
        seen.dump_signal = signum if isinstance(signum, int) else None
        seen.closed = dump.closed
        if dump.num_dumps > seen.num_dumps and not dump.closed:
            seen.num_dumps = dump.num_dumps
            self._send(path, dump, seen)

    def _signal_if_silent(self, path: Path, seen: _Seen, now: float) -> bool:
        """Send the dump signal to the rank's watchdog thread when it has reported nothing for
        its `dump_after_s` while this thread saw the rank run; whether it was sent.

        A stopped rank is never signalled: nothing runs in it to answer, and its handler
        would dump the stacks when it resumes, while its threads run again.
        """
        if seen.dump_signal is None or seen.pid <= 0:
            return False
        if is_stopped(seen.pid):
            seen.watched_since = now
            return False
        last = read_last_report(path) or {}
        ts, tid, after_s = last.get("ts"), last.get("watchdog_tid"), last.get("dump_after_s")
        if not (
            isinstance(ts, int | float)
            and isinstance(tid, int)
            and isinstance(after_s, int | float)
        ):
            return False
        silent_since = max(ts, seen.watched_since, seen.signalled_at or 0.0)
        if now - silent_since < after_s:
            return False
        # Its profiler closing keeps the handler; a rank that never had one would be ended.
        if not _catches(seen.pid, seen.dump_signal):
            return False
        if not signal_thread(seen.pid, tid, seen.dump_signal):
            return False
        seen.signalled_at = now
        self.num_signals += 1
        return True

    def _wait_for_dump(self, path: Path, size: int) -> None:
        """Wait (at most DUMP_WAIT_S) until the signalled rank's file grew and settled."""
        deadline = time.monotonic() + DUMP_WAIT_S
        last = size
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now_size = _size(path)
            if now_size > size and now_size == last:
                return
            last = now_size

    def _died(self, path: Path, dump: Dump, seen: _Seen) -> None:
        pid = int(dump.identity.get("pid") or 0)
        status = self.exit_codes.get(pid)
        sys.stderr.write(
            f"stepscope: rank {dump.identity.get('rank')} (pid {pid}) ended without closing "
            f"its profiler{'' if status is None else f', exit status {status}'}\n"
        )
        self._send(path, dump, seen)

    def _send(self, path: Path, dump: Dump, seen: _Seen) -> None:
        error = post_report(self._poster, self.report(path, dump, seen), token=self._token)
        if error is None:
            self.num_reports += 1
        else:
            log.warning("stepscope: a faulthandler hang report was not delivered: %s", error)

    def report(self, path: Path, dump: Dump, seen: _Seen) -> dict[str, Any]:
        """A hang report of the rank: its watchdog's last one, with faulthandler's stack."""
        identity = {k: dump.identity.get(k) for k in _IDENTITY}
        last = read_last_report(path) or {}
        now = time.time()
        last_progress_ts = last.get("last_progress_ts")
        if last_progress_ts is None:
            last_progress_ts = last.get("ts", now)
        return {
            "schema": HANG_SCHEMA_VERSION,
            **identity,
            "ts": round(now, 3),
            "kind": "hang",
            "step": last.get("step"),
            "section": last.get("section"),
            "phase": last.get("phase"),
            "last_progress_ts": round(float(last_progress_ts), 3),
            "stalled_s": round(max(0.0, now - float(last_progress_ts)), 3),
            "blocked": last.get("blocked"),
            "frontiers": last.get("frontiers") or [],
            "stack": dump.stack,
            "stack_source": "faulthandler" if dump.stack is not None else None,
        }


_IDENTITY = ("job_id", "rank", "incarnation", "node", "pid", "world_size")


def _alive(pid: int) -> bool:
    """Whether the rank with this pid still runs (True when unknown)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return _process_state(pid) != "Z"


def _process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, D, T, t, Z...); None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a scheduler's suspend, a debugger) or its
    cgroup frozen (a paused container); also True when this cannot be told (no /proc)."""
    state = _process_state(pid)
    return state is None or state in ("T", "t") or _cgroup_frozen(pid)


def _cgroup_frozen(pid: int) -> bool:
    """Whether the process's cgroup (v2) is frozen: its tasks then sleep, not stop."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            unified = [line[3:].strip() for line in f if line.startswith("0::")]
        if not unified:
            return False
        with open(f"/sys/fs/cgroup{unified[0].rstrip('/')}/cgroup.events", encoding="utf-8") as f:
            return "frozen 1" in (line.strip() for line in f)
    except OSError:
        return False


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum` (SigCgt in /proc/<pid>/status)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, StopIteration, IndexError, ValueError):
        return False


_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}
"""tgkill's system call number, for a libc without the tgkill function (glibc < 2.30)."""


@functools.cache
def _tgkill() -> Callable[[int, int, int], int] | None:
    """libc's tgkill (or the system call); None where there is none (not Linux)."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    function = getattr(libc, "tgkill", None)
    if function is not None:
        return function
    number = _SYS_TGKILL.get(platform.machine())
    syscall = getattr(libc, "syscall", None)
    if number is None or syscall is None:
        return None
    return lambda tgid, tid, signum: int(syscall(number, tgid, tid, signum))


def signal_thread(pid: int, tid: int, signum: int) -> bool:
    """Send `signum` to one thread of process `pid` (its native id `tid`), not to the process,
    whose signals land on the training thread and cut its system calls short; whether it
    was sent."""
    tgkill = _tgkill()
    return tgkill is not None and tgkill(pid, tid, signum) == 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1
