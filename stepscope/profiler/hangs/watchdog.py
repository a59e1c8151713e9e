"""The progress watchdog: a thread that notices when a rank stops making progress and says where.

Progress is a step ending, a section or phase changing, or a collective completing. The
training thread only stores what it already has (the step, the section, a timestamp); this
thread polls those, the process groups' frontiers and the collective the training thread is
blocked in. After `hang_after_s` without progress it captures the training thread's stack
(`sys._current_frames()`: c10d's waits release the GIL) and POSTs a `hang` report to
{url}/v1/hangs, then again every heartbeat_s while the hang lasts; otherwise a `heartbeat`
every heartbeat_s, so that the server tells a silent rank from a busy one.

When the training thread holds the GIL this thread cannot run, and its reports stop:
`stepscope run` (hangs/dump_watcher.py) then sends this thread the dump signal, on which
`faulthandler`'s handler writes every thread's stack to a per-rank file that it ships. No
timer runs inside the rank: a rank stopped (SIGSTOP, a scheduler's suspend) is never
signalled, and finds nothing due when it resumes. Any internal error stops the watchdog
(logged once); training never notices.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from stepscope.profiler.hangs.reports import (
    CLOSED_MARK,
    DUMP_SIGNAL,
    FLIGHT_RECORDER_REQUEST,
    HANG_SCHEMA_VERSION,
    Frame,
    ReportKind,
    dump_file_name,
    dump_header,
    flight_recorder_file_name,
    hangs_endpoint,
    last_report_path,
    post_report,
    write_last_report,
)
from stepscope.profiler.shipping.transport import Poster

if TYPE_CHECKING:
    from stepscope.profiler.collectives.calls import CollectiveCall
    from stepscope.profiler.collectives.groups import GroupRegistry
    from stepscope.profiler.config import Config

log = logging.getLogger(__name__)

POLL_S = 0.1
"""How often the watchdog looks at the training thread's progress, at the shortest."""
MAX_POLL_S = 0.5
"""...and at the longest: it looks every 1/POLLS_PER_THRESHOLD of the hang threshold."""
POLLS_PER_THRESHOLD = 10
FLOOR_S = 5.0
"""The adaptive threshold is never shorter than this, in seconds."""
STEP_MULTIPLE = 5.0
"""The adaptive threshold is this many times the rolling p99 of the step cycle time."""
WARMUP_STEPS = 5
"""Until this many steps ended (compilation, first collectives, caches) the threshold is long."""
LONG_S = 600.0
"""The threshold during the first steps and inside declared phases, in seconds."""
_NUM_CYCLES = 256
"""Step cycle times the rolling p99 is taken over."""
_MAX_FRAMES = 256
MAX_FRONTIERS = 64
MAX_TEXT_CHARS = 1024
"""The server's limits on one report (frontiers, characters of a file name)."""
_MAX_HTTP_TIMEOUT_S = 2.0


DeviceCalls = Callable[[], "tuple[list[CollectiveCall], Callable[[Any], bool]] | None"]
"""The collectives not yet shipped and the clock's is_ready, when the clock is a device's."""


@dataclass(frozen=True, slots=True)
class TrainingState:
    """What the training thread last stored about its progress (read, never waited for)."""

    step: int | None
    """The last step entered (None before the first)."""
    first_step: int | None
    ended_step: int | None
    """The last step that ended."""
    ended_at: float | None
    """When it ended (time.perf_counter)."""
    section: str | None
    phase: str | None
    phase_changed_at: float | None
    """When a phase last began or ended (time.perf_counter)."""


class Watchdog:
    """One rank's progress watchdog thread; start() it, stop() it at close."""

    def __init__(
        self,
        *,
        config: Config,
        identity: dict[str, Any],
        state: Callable[[], TrainingState],
        groups: GroupRegistry,
        waiting: Callable[[], CollectiveCall | None],
        main_thread_id: int,
        device_calls: DeviceCalls | None = None,
    ) -> None:
        assert config.url is not None
        self._hang_after_s = config.hang_after_s
        self._heartbeat_s = config.heartbeat_s
        self._token = config.token
        self._http_timeout_s = min(config.http_timeout_s, _MAX_HTTP_TIMEOUT_S)
        self._poster = Poster(hangs_endpoint(config.url), timeout_s=self._http_timeout_s)
        self._identity = identity
        self._state = state
        self._groups = groups
        self._waiting = waiting
        self._main_thread_id = main_thread_id
        self._device_calls = device_calls
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepscope-watchdog", daemon=True)
        self._pid = os.getpid()
        self._dump_dir = config.hang_dump_dir
        self._dump_path: Path | None = None
        self._dump_file: IO[str] | None = None
        self._dump_header_bytes = 0
        # What the watchdog has seen so far (only its own thread touches these).
        self._signature: tuple[Any, ...] | None = None
        self._last_progress = time.perf_counter()
        self._steps_done = 0
        self._cycles_s: deque[float] = deque(maxlen=_NUM_CYCLES)
        self._p99_s: float | None = None
        self._phase: str | None = None
        self._blocked_call: Any = None
        self._blocked_since_ts: float | None = None
        self._delivery_error: str | None = None
        self._flight_recorder_dumped = False
        self.num_reports: dict[str, int] = {"heartbeat": 0, "hang": 0}
        """Reports acknowledged by the server, by kind (for tests and benchmarks)."""

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._pid = os.getpid()
        self._open_dump_file()
        self._thread.start()
        atexit.register(self.stop)  # a rank that ends without close() did not die

    def stop(self, timeout_s: float = 0.0) -> None:
        """Stop the thread; removes a dump file that stayed empty."""
        self._stop.set()
        atexit.unregister(self.stop)
        if os.getpid() != self._pid:  # a forked child: the dump file is the parent's
            return
        self._close_dump_file()
        if (
            timeout_s > 0
            and self._thread.is_alive()
            and threading.current_thread() is not self._thread
        ):
            self._thread.join(timeout_s)

    def hang_after_s(self) -> float:
        """The stall, in seconds, after which the rank reports a hang now."""
        base_s = self._hang_after_s if self._hang_after_s is not None else FLOOR_S
        if self._steps_done < WARMUP_STEPS or self._phase is not None:
            return max(base_s, LONG_S)
        if self._hang_after_s is not None:
            return self._hang_after_s
        if self._p99_s is None:
            return LONG_S
        return max(FLOOR_S, STEP_MULTIPLE * self._p99_s)

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            hung = False
            next_report = 0.0
            poll_s = POLL_S
            while not self._stop.wait(poll_s):
                now = time.perf_counter()
                state = self._observe(now)
                threshold_s = self.hang_after_s()
                # A hang is seen within a tenth of its threshold, at 2-10 looks a second: a look
                # costs ~0.1 ms of CPU on a core the training keeps busy.
                poll_s = min(MAX_POLL_S, max(POLL_S, threshold_s / POLLS_PER_THRESHOLD))
                self._serve_flight_recorder_request()
                stalled_s = now - self._last_progress
                if stalled_s >= threshold_s:
                    if not hung or now >= next_report:
                        self._send("hang", state, now)
                        next_report = time.perf_counter() + self._heartbeat_s
                    hung = True
                elif hung or now >= next_report:  # progress resumed: say so at once
                    hung = False
                    self._send("heartbeat", state, now)
                    next_report = time.perf_counter() + self._heartbeat_s
        except Exception:
            log.exception("stepscope: the hang watchdog stopped after an internal error")
            self.stop()
        finally:
            self._poster.close()

    def _observe(self, now: float) -> TrainingState:
        """Read the training thread's state; note progress and step cycle times."""
        state = self._state()
        completed = tuple(info.completed_seq for info in self._groups.all_groups())
        signature = (
            state.step,
            state.ended_step,
            state.ended_at,
            state.section,
            state.phase,
            state.phase_changed_at,
            completed,
        )
        previous = self._signature
        if signature != previous:
            self._last_progress = now
            self._signature = signature
            if previous is None or state.ended_at != previous[2]:
                self._step_ended(state, previous)
        self._phase = state.phase
        call = self._waiting()
        if call is not self._blocked_call:
            self._blocked_call = call
            self._blocked_since_ts = time.time() if call is not None else None
            start = getattr(call, "start", None)
            if isinstance(start, float):  # the CPU clock's marks are perf_counter readings
                self._blocked_since_ts = time.time() - (now - start)
        return state

    def _step_ended(self, state: TrainingState, previous: tuple[Any, ...] | None) -> None:
        """Count the steps done and note the step cycle time since the last step end seen."""
        if state.ended_step is None or state.first_step is None:
            return
        # Several steps may have ended between two looks; step indices the user gives may
        # also start over (per epoch): the count only grows.
        self._steps_done = max(self._steps_done + 1, state.ended_step - state.first_step + 1)
        previous_step, previous_at = (None, None) if previous is None else previous[1:3]
        num_steps = 1
        if previous_step is not None:
            num_steps = max(1, state.ended_step - previous_step)
        if previous_at is not None and state.ended_at is not None:
            self._cycles_s.append((state.ended_at - previous_at) / num_steps)
            ordered = sorted(self._cycles_s)  # at most once a look (0.1 s): ~6 µs
            self._p99_s = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    # ---- reports --------------------------------------------------------------------------

    def report(self, kind: ReportKind, state: TrainingState, now: float) -> dict[str, Any]:
        """The wire report of this rank now (see reports.py and the /v1/hangs spec)."""
        wall_now = time.time()
        stalled_s = max(0.0, now - self._last_progress)
        call = self._blocked_call
        blocked = None
        # A send or recv waits in its channel, which counts that pair's messages.
        group, seq = (call.group, call.seq) if call is not None else (None, None)
        if call is not None and seq is None and call.channel is not None:
            group, seq = call.channel, call.channel_seq
        if call is not None and group is not None and seq is not None:
            blocked = {
                "group": group.name,
                "op": call.op,
                "seq": seq,
                "since_ts": _round(self._blocked_since_ts),
                "bytes": call.num_bytes,
            }
        unfinished = self._unfinished_on_device()
        groups = self._groups.all_groups()
        if len(groups) > MAX_FRONTIERS:  # the groups in flight first, then the busiest
            groups.sort(key=lambda g: (g.seq > g.completed_seq, g.seq), reverse=True)
            groups = groups[:MAX_FRONTIERS]
        frontiers = [
            {
                "group": info.name,
                "mesh_dim": self._groups.mesh_dim(info.name),
                "group_ranks": info.ranks,
                "size": info.size,
                "enqueued": info.seq,
                "completed": min(info.completed_seq, unfinished.get(info.name, info.seq + 1) - 1),
            }
            for info in groups
        ]
        # Past half its threshold, a stalled rank's heartbeats carry its stack as well: its
        # peers' last progress may have come earlier (a p2p transfer completing counts as
        # progress here), so that they report the hang first and the server names this rank
        # with the stack of its last report.
        with_stack = kind == "hang" or stalled_s >= self.hang_after_s() / 2
        stack = main_stack(self._main_thread_id) if with_stack else None
        return {
            "schema": HANG_SCHEMA_VERSION,
            **self._identity,
            "ts": _round(wall_now),
            "kind": kind,
            "step": state.step,
            "section": state.section,
            "phase": state.phase,
            "last_progress_ts": _round(wall_now - stalled_s),
            "stalled_s": _round(stalled_s),
            "blocked": blocked,
            "frontiers": frontiers,
            "stack": stack,
            "stack_source": "watchdog" if stack is not None else None,
        }

    def _unfinished_on_device(self) -> dict[str, int]:
        """Per group, the lowest sequence number not yet complete on the device (GPU only:
        a CUDA work's future completes at enqueue, its end event when the device is done)."""
        found = self._device_calls() if self._device_calls is not None else None
        if found is None:
            return {}
        calls, is_ready = found
        return lowest_unfinished_seqs(calls, is_ready)

    def _send(self, kind: ReportKind, state: TrainingState, now: float) -> None:
        report = self.report(kind, state, now)
        if self._dump_path is not None:
            # `stepscope run` answers a silence with the dump signal: one longer than the
            # threshold, and than this thread's own gaps (a report is due every heartbeat_s,
            # sent at the next look, and a POST may take the HTTP timeout).
            gap_s = max(self.hang_after_s(), self._heartbeat_s + MAX_POLL_S)
            write_last_report(
                self._dump_path,
                report,
                watchdog_tid=threading.get_native_id(),
                dump_after_s=gap_s + self._http_timeout_s,
            )
        error = post_report(self._poster, report, token=self._token)
        if error is None:
            self.num_reports[kind] += 1
            if self._delivery_error is not None:
                log.info("stepscope: hang reports delivered again after: %s", self._delivery_error)
                self._delivery_error = None
        elif self._delivery_error is None:
            log.warning("stepscope: hang report not delivered to %s: %s", self._poster.url, error)
            self._delivery_error = error

    # ---- the flight recorder, on `stepscope run --on-hang dump-and-exit`'s request -----------

    def _serve_flight_recorder_request(self) -> None:
        """Dump c10d's flight recorder once, when `stepscope run` asks for it (a file in the
        dump directory) before it ends the job."""
        path = self._dump_path
        if self._flight_recorder_dumped or path is None:
            return
        if not (path.parent / FLIGHT_RECORDER_REQUEST).exists():
            return
        self._flight_recorder_dumped = True
        name = flight_recorder_file_name(
            str(self._identity["job_id"]), int(self._identity["rank"]), os.getpid()
        )
        dump_flight_recorder(path.parent / name)

    # ---- faulthandler: the stack when this thread cannot run -------------------------------

    def _open_dump_file(self) -> None:
        if not self._dump_dir:
            return
        try:
            directory = Path(self._dump_dir)
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / dump_file_name(
                str(self._identity["job_id"]), int(self._identity["rank"]), os.getpid()
            )
            file = path.open("w", encoding="utf-8")
        except OSError as exc:
            log.warning("stepscope: no faulthandler stack dumps (%s)", exc)
            return
        # The handler first: `stepscope run` signals only a rank whose header names it.
        dump_signal = _dump_stacks_on_signal(self, file)
        header = dump_header(self._identity, self._main_thread_id, dump_signal=dump_signal)
        try:
            file.write(header)
            file.flush()
        except OSError as exc:
            log.warning("stepscope: no faulthandler stack dumps (%s)", exc)
            _stop_dumping_stacks(self)
            file.close()
            return
        self._dump_path, self._dump_file = path, file
        self._dump_header_bytes = len(header.encode())

    def _close_dump_file(self) -> None:
        file, self._dump_file = self._dump_file, None
        if file is None:
            return
        try:
            _stop_dumping_stacks(self)
            file.close()
            path = self._dump_path
            if path is None:
                return
            last_report_path(path).unlink(missing_ok=True)
            if path.stat().st_size <= self._dump_header_bytes:
                path.unlink()
            else:  # it holds dumps of a stall this rank lived through: keep it, marked closed
                with path.open("a", encoding="utf-8") as marked:
                    marked.write(CLOSED_MARK)
        except OSError:
            log.debug("stepscope: could not tidy the dump file", exc_info=True)


_dump_signal_lock = threading.Lock()
_dump_signal_owner: Watchdog | None = None
"""The watchdog whose dump file faulthandler writes to on DUMP_SIGNAL (the latest started)."""
_devnull: IO[str] | None = None


def _dump_stacks_on_signal(watchdog: Watchdog, file: IO[str]) -> int | None:
    """Have faulthandler write every thread's stack to `file` on DUMP_SIGNAL; the signal, or
    None when this process cannot (no such signal, or the program handles it itself)."""
    global _dump_signal_owner
    signum = DUMP_SIGNAL
    if signum is None or not hasattr(faulthandler, "register"):
        return None
    with _dump_signal_lock:
        if _dump_signal_owner is None and signal.getsignal(signum) != signal.SIG_DFL:
            log.warning("stepscope: signal %d is the program's: no stack dumps on it", signum)
            return None
        try:
            faulthandler.register(signum, file=file, all_threads=True, chain=False)
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("stepscope: no stack dumps on signal %d (%s)", signum, exc)
            return None
        _dump_signal_owner = watchdog
    return signum


def _stop_dumping_stacks(watchdog: Watchdog) -> None:
    """Point the handler at /dev/null before the dump file closes. It stays installed: a
    signal already on its way must not meet the default action, which ends the process."""
    global _dump_signal_owner, _devnull
    with _dump_signal_lock:
        if _dump_signal_owner is not watchdog or DUMP_SIGNAL is None:
            return
        _dump_signal_owner = None
        try:
            if _devnull is None:
                _devnull = open(os.devnull, "w", encoding="utf-8")
            faulthandler.register(DUMP_SIGNAL, file=_devnull, all_threads=True, chain=False)
        except (OSError, RuntimeError, ValueError):
            log.debug("stepscope: could not point the stack dumps at /dev/null", exc_info=True)


def dump_flight_recorder(path: Path) -> bool:
    """Write c10d's flight recorder (its collectives, without stack traces: those take the
    GIL and seconds) to `path`, atomically; False when it could not."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]

        data = _dump_fr_trace(includeCollectives=True, includeStackTraces=False)
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)
    except Exception as exc:  # no flight recorder in this build, a full disk...
        log.warning("stepscope: could not dump the flight recorder to %s: %s", path, exc)
        return False
    return True


def lowest_unfinished_seqs(
    calls: Iterable[CollectiveCall], is_ready: Callable[[Any], bool]
) -> dict[str, int]:
    """Per group name, the lowest sequence number among calls whose end has not happened."""
    lowest: dict[str, int] = {}
    for call in calls:
        seq = call.seq
        if seq is None or (call.end is not None and is_ready(call.end)):
            continue
        name = call.group.name
        if seq < lowest.get(name, seq + 1):
            lowest[name] = seq
    return lowest


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""stepscope/profiler/, whose frames (the tap's, zero-code's hooks) are not the training code's."""


def main_stack(thread_id: int, *, limit: int = _MAX_FRAMES) -> list[Frame] | None:
    """A thread's current Python stack, innermost last (its innermost `limit` frames), without
    the profiler's own innermost frames."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
        frame = frame.f_back  # the tap's wrappers around a wait: not the training code's
    frames: list[Frame] = []
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        frames.append(
            {
                "file": code.co_filename[-MAX_TEXT_CHARS:],
                "line": frame.f_lineno or 0,
                "function": code.co_name[:MAX_TEXT_CHARS],
            }
        )
        frame = frame.f_back
    frames.reverse()
    return frames


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
