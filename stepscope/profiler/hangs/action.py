"""`stepscope run --on-hang dump-and-exit`: once the server confirms a hang, dump the ranks'
flight recorders and end the job, so that the scheduler restarts it (off by default).

The server confirms a hang when it stores an open `hang` finding for the job; this thread
polls `GET /api/v1/jobs/{id}/hang` for it (a token needs the `read` scope). It then asks the
ranks' watchdogs to dump c10d's flight recorder (a request file in the dump directory), waits
for their dumps, and ends the command with SIGTERM (SIGKILL if it lingers). Stdlib only.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from stepscope.profiler.hangs.reports import FLIGHT_RECORDER_REQUEST

log = logging.getLogger(__name__)

ON_HANG_ACTIONS = ("dump-and-exit",)
POLL_S = 1.0
"""How often the server is asked whether the job hangs."""
DUMP_WAIT_S = 10.0
"""How long the ranks get to dump their flight recorders."""
TERM_GRACE_S = 15.0
"""How long the command gets to end after SIGTERM before SIGKILL."""
_HTTP_TIMEOUT_S = 5.0


class HangAction:
    """Polls the server for the job's confirmed hang and ends `child` when there is one."""

    def __init__(
        self,
        child: subprocess.Popen[Any],
        *,
        url: str,
        job_id: str,
        token: str | None,
        dump_dir: Path | None,
        poll_s: float = POLL_S,
    ) -> None:
        self._child = child
        self._endpoint = f"{url.rstrip('/')}/api/v1/jobs/{quote(job_id, safe='')}/hang"
        self._token = token
        self._dump_dir = dump_dir
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepscope-on-hang", daemon=True)
        self._started_at = time.time()
        self.fired_at: float | None = None
        """When the action began (epoch s); None if it did not."""
        self.flight_recorder_files: list[Path] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(_HTTP_TIMEOUT_S + 1.0)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._poll_s):
                hang = self._confirmed_hang()
                if hang is not None:
                    self._dump_and_exit(hang)
                    return
        except Exception:
            log.exception("stepscope: the --on-hang action stopped after an internal error")

    def _confirmed_hang(self) -> dict[str, Any] | None:
        """The job's open hang finding, or None (also when the server cannot say)."""
        request = urllib.request.Request(self._endpoint)
        if self._token:
            request.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                sys.stderr.write(
                    f"stepscope: --on-hang is off: {self._endpoint} answered {exc.code} "
                    "(the token needs the read scope)\n"
                )
                self._stop.set()
            return None  # 404 until the job's first batch is stored
        except (OSError, ValueError):
            return None
        hang = body.get("hang") if isinstance(body, dict) else None
        if not isinstance(hang, dict):
            return None
        # A hang stored before this run began is an earlier incarnation's (a restart under
        # the same job id): ending this run for it would restart the job in a loop.
        detected_at = hang.get("detected_at")
        if not isinstance(detected_at, int | float) or detected_at < self._started_at:
            return None
        return hang

    def _dump_and_exit(self, hang: dict[str, Any]) -> None:
        self.fired_at = time.time()
        evidence = hang.get("evidence") or {}
        sys.stderr.write(
            f"stepscope: hang confirmed ({evidence.get('class')}, ranks {hang.get('ranks')}, "
            f"{evidence.get('group')} {evidence.get('op')} #{evidence.get('seq')}): dumping the "
            "flight recorder and ending the job\n"
        )
        self.flight_recorder_files = self._dump_flight_recorders()
        if self._child.poll() is None:
            self._child.terminate()
            try:
                self._child.wait(TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                self._child.kill()

    def _dump_flight_recorders(self) -> list[Path]:
        """Ask the ranks on this node to dump their flight recorders; the files written."""
        directory = self._dump_dir
        if directory is None:
            return []
        request = directory / FLIGHT_RECORDER_REQUEST
        try:
            request.write_text(f"{time.time()}\n", encoding="utf-8")
        except OSError as exc:
            sys.stderr.write(f"stepscope: cannot ask for flight recorder dumps: {exc}\n")
            return []
        # One dump per live rank: each has a stack-dump file while its profiler runs.
        num_ranks = len(list(directory.glob("stepscope-*.txt")))
        deadline = time.monotonic() + (DUMP_WAIT_S if num_ranks else 0.0)
        dumps = sorted(directory.glob("stepscope-*.fr.pickle"))
        while len(dumps) < num_ranks and time.monotonic() < deadline:
            time.sleep(0.1)
            dumps = sorted(directory.glob("stepscope-*.fr.pickle"))
        request.unlink(missing_ok=True)
        where = ", ".join(str(p) for p in dumps) or "none written"
        sys.stderr.write(f"stepscope: flight recorder dumps: {where}\n")
        return dumps
