"""Hang reports on the wire (POST /v1/hangs) and the faulthandler dump files they can come from.

Stdlib only: the watchdog thread inside every rank and `stepscope run` (which may run
without torch) both send reports; `stepscope run` also reads the per-rank dump files that
`faulthandler` writes when it signals a rank whose watchdog cannot run (it holds the GIL).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import signal
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stepscope.profiler.shipping.transport import Poster

log = logging.getLogger(__name__)

HANG_SCHEMA_VERSION = 1
ReportKind = Literal["heartbeat", "hang"]
StackSource = Literal["watchdog", "faulthandler"]

Frame = dict[str, Any]
"""One stack frame on the wire: {"file": str, "line": int, "function": str}."""

_HEADER_PREFIX = "# stepscope hang dump "
CLOSED_MARK = "# stepscope closed\n"
"""Appended when the profiler closes a file that holds dumps: the rank did not die."""
_THREAD_LINE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME_LINE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>\S+)')

DUMP_SIGNAL: int | None = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None
"""The signal on which a rank writes every thread's stack to its dump file (faulthandler's
handler, which runs while another thread holds the GIL); `stepscope run` sends it to a rank
whose watchdog went silent and that is not stopped. A real-time signal: torchrun forwards
SIGTERM, SIGINT, SIGHUP and SIGQUIT, Slurm jobs use SIGUSR1 and SIGUSR2 (Lightning's and
submitit's requeue), and glibc keeps the real-time signals below SIGRTMIN. None where there
are none (not Linux): no dumps."""


def hangs_endpoint(url: str) -> str:
    return url.rstrip("/") + "/v1/hangs"


def post_report(poster: Poster, report: dict[str, Any], *, token: str | None) -> str | None:
    """POST one report (gzip JSON) to hangs_endpoint(); None when acknowledged, else what
    went wrong. Never raises."""
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        body = gzip.compress(json.dumps(report, separators=(",", ":")).encode(), compresslevel=1)
        poster.post(body, headers)
        return None
    except urllib.error.HTTPError as exc:
        try:
            detail = exc.read()[:300].decode(errors="replace")
        except OSError:
            detail = ""
        return f"HTTP {exc.code}: {detail}"
    except Exception as exc:  # URLError, timeouts, resets, bad status lines, bad values
        return f"{type(exc).__name__}: {exc}"


# ---- faulthandler dump files --------------------------------------------------------------


def dump_file_name(job_id: str, rank: int, pid: int) -> str:
    safe_job_id = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)
    return f"stepscope-{safe_job_id}-rank{rank}-{pid}.txt"


FLIGHT_RECORDER_REQUEST = "dump-flight-recorder.request"
"""A file `stepscope run` writes in the dump directory: each rank's watchdog then dumps its
flight recorder next to it (its --on-hang action)."""


def flight_recorder_file_name(job_id: str, rank: int, pid: int) -> str:
    """Where a rank dumps its flight recorder (the pickle torch's fr_trace tool reads)."""
    return dump_file_name(job_id, rank, pid).replace(".txt", ".fr.pickle")


def dump_header(
    identity: dict[str, Any], main_thread_id: int, *, dump_signal: int | None = None
) -> str:
    """The first line of a rank's dump file: who wrote it, which thread is the training one and
    the signal it dumps its stacks on (None: it does not)."""
    doc = {**identity, "main_thread": f"0x{main_thread_id:x}", "dump_signal": dump_signal}
    return _HEADER_PREFIX + json.dumps(doc) + "\n"


def last_report_path(dump_path: Path) -> Path:
    """Where the watchdog keeps its last report next to the dump file (step, frontiers...)."""
    return dump_path.with_suffix(".last.json")


def write_last_report(
    dump_path: Path, report: dict[str, Any], *, watchdog_tid: int, dump_after_s: float
) -> None:
    """Replace the last report kept next to a dump file (never raises), with what `stepscope
    run` needs to signal the rank if its watchdog goes silent: the watchdog thread's native
    id and how long a silence is one (`dump_after_s`)."""
    path = last_report_path(dump_path)
    doc = {**report, "watchdog_tid": watchdog_tid, "dump_after_s": dump_after_s}
    try:
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
        os.replace(temporary, path)
    except OSError:
        log.debug("stepscope: could not keep the last report in %s", path, exc_info=True)


def read_last_report(dump_path: Path) -> dict[str, Any] | None:
    try:
        report = json.loads(last_report_path(dump_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


@dataclass(slots=True)
class Dump:
    """What a rank's dump file holds: the writer's identity and the dumps written so far."""

    identity: dict[str, Any]
    """job_id, rank, incarnation, node, pid, world_size, main_thread (hex), dump_signal."""
    num_dumps: int
    stack: list[Frame] | None
    """The training thread's stack in the last dump, innermost last."""
    closed: bool
    """The profiler closed the file (the rank ended its run)."""


def read_dump(path: Path) -> Dump | None:
    """Parse a rank's dump file; None when it is not one (no stepscope header)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    if not lines or not lines[0].startswith(_HEADER_PREFIX):
        return None
    try:
        identity = json.loads(lines[0][len(_HEADER_PREFIX) :])
    except ValueError:
        return None
    main_thread = int(str(identity.get("main_thread", "0x0")), 16)
    # A dump lists every thread once, the most recent call first, with no line of its own:
    # the dumps are counted by how often a thread is listed.
    times_listed: dict[int, int] = {}
    stack: list[Frame] | None = None
    frames: list[Frame] | None = None
    for line in lines[1:]:
        thread = _THREAD_LINE.match(line)
        if thread is not None:
            thread_id = int(thread[1], 16)
            times_listed[thread_id] = times_listed.get(thread_id, 0) + 1
            frames = [] if thread_id == main_thread else None
            if frames is not None:
                stack = frames
            continue
        frame = _FRAME_LINE.match(line)
        if frame is not None and frames is not None:
            # faulthandler writes the most recent call first; the wire wants it last.
            frames.insert(
                0,
                {"file": frame["file"], "line": int(frame["line"]), "function": frame["function"]},
            )
    return Dump(
        identity=identity,
        num_dumps=max(times_listed.values(), default=0),
        stack=stack,
        closed=lines[-1] == CLOSED_MARK.strip(),
    )
