"""`stepscope run`'s side of hang reporting: the ranks whose watchdog cannot speak.

A rank that holds the GIL cannot run its watchdog thread; faulthandler's C timer then
writes its stacks to the rank's dump file (stepscope.profiler.hangs.watchdog). A rank that died
(killed, crashed) leaves its dump file behind, unclosed. This thread, in the process that
wraps a node's ranks, ships both as `hang` reports with stack_source "faulthandler", built
on the last report the rank's watchdog sent (its step, section and frontiers). Stdlib only.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
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
_HTTP_TIMEOUT_S = 2.0


@dataclass(slots=True)
class _Seen:
    size: int = -1
    num_dumps: int = 0
    first_dump_ts: float | None = None
    died: bool = False
    pid: int = 0


class DumpWatcher:
    """Polls a directory of per-rank dump files and reports what the ranks could not."""

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
        self._started_at = time.time()
        self.owns_dir = False
        """The directory was made for this run (removed at the end when empty)."""

    def start(self) -> None:
        self._started_at = time.time()
        self._thread.start()

    def stop(self) -> None:
        """Stop polling, after a last look (ranks that died at the end are reported)."""
        self._stop.set()
        self._thread.join(POLL_S + 2 * _HTTP_TIMEOUT_S + 1.0)
        try:
            self.poll()
        except Exception:
            log.exception("stepscope: could not read the ranks' dump files")

    def _run(self) -> None:
        try:
            while not self._stop.wait(POLL_S):
                self.poll()
        except Exception:
            log.exception("stepscope: stopped watching the ranks' dump files after an error")

    def poll(self) -> None:
        """Report new faulthandler dumps, and ranks that died without closing their file."""
        for path in sorted(self.dump_dir.glob("stepscope-*.txt")):
            try:
                stat = path.stat()
            except OSError:  # closed and removed by its rank
                continue
            seen = self._seen.get(path)
            if seen is None:
                # A file from an earlier run in a directory the user gave is not ours to report.
                seen = self._seen[path] = _Seen(died=stat.st_mtime < self._started_at - 1.0)
            size = stat.st_size
            if seen.died:
                continue
            dump = read_dump(path) if size != seen.size else None
            seen.size = size
            if dump is not None:
                seen.pid = int(dump.identity.get("pid") or 0)
            if dump is not None and dump.num_dumps > seen.num_dumps and not dump.closed:
                seen.num_dumps = dump.num_dumps
                if seen.first_dump_ts is None:
                    seen.first_dump_ts = time.time()
                self._send(path, dump, seen)
            if not _alive(seen.pid) and (
                seen.pid not in self.children or seen.pid in self.exit_codes
            ):
                seen.died = True
                dump = dump or read_dump(path)
                if dump is not None and not dump.closed:
                    self._died(path, dump, seen)

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
        if last_progress_ts is None and seen.first_dump_ts is not None:
            last_progress_ts = seen.first_dump_ts - (dump.timeout_s or 0.0)
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
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
