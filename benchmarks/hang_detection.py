"""Stall → stored hang finding on a real job (#19): 4 torchrun ranks (gloo, CPU) with 1 s steps
stream to a real `stepscope serve`; rank 2 sleeps in its data loader at step 10 for good.
Printed per setting, beside the goal: the time from the stall to the stored finding, its
class and culprit. Settings: the defaults (the adaptive threshold: 5 x the p99 step time, at
least 5 s; heartbeats every 2 s) and a tuned one (hang_after_s 2, heartbeats every 0.5 s).

    python benchmarks/hang_detection.py [--step-s 1.0] [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.live_server import RunningServer, read_rows, run_server  # noqa: E402
from tests.profiler import hang_job  # noqa: E402

SETTINGS = {
    "defaults": ([], 10.0),
    "tuned (hang_after_s 2, heartbeat_s 0.5)": (
        ["--hang-after-s", "2", "--heartbeat-s", "0.5"],
        3.0,
    ),
}
"""Name → (the job's extra arguments, the goal for stall → finding in seconds)."""
TIMEOUT_S = 180.0


def stall_to_finding(
    server: RunningServer, job_id: str, args: list[str], step_s: float
) -> tuple[float, str]:
    """Run the job until its hang is stored; seconds from the stall to it, and whom it names."""
    with tempfile.TemporaryDirectory(prefix="stepscope-hang-") as tmp:
        out = Path(tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
        env.update(OMP_NUM_THREADS="1", STEPSCOPE_URL=server.url, STEPSCOPE_JOB_ID=job_id)
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", "--nproc_per_node=4", hang_job.__file__]
        cmd += ["--scenario", "stall", "--out", str(out), "--step-s", str(step_s), *args]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline and proc.poll() is None:
                rows = [
                    r for r in read_rows(server.db_url, "findings", job_id) if r["kind"] == "hang"
                ]
                if rows:
                    break
                time.sleep(0.1)
            else:
                raise SystemExit(f"no hang stored for {job_id} (job exit {proc.returncode})")
        finally:
            pids = [json.loads((out / f"rank{r}.json").read_text())["pid"] for r in range(4)]
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
        stall_ts = json.loads((out / f"rank{hang_job.DATA_STALL_RANK}.json").read_text())
        evidence = rows[0]["evidence"]
        evidence = json.loads(evidence) if isinstance(evidence, str) else evidence
        elapsed_s = rows[0]["detected_at"] - stall_ts["data_stall"]
        return elapsed_s, f"{evidence['class']} {rows[0]['ranks']}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print(f"stall -> stored hang finding, 4 gloo ranks, {args.step_s} s steps, rank 2 stalls")
    print(f"{'setting':<42} {'runs (s)':<22} {'median':>7} {'goal':>6}  named")
    with run_server() as server:
        for i, (name, (extra, goal_s)) in enumerate(SETTINGS.items()):
            results = [
                stall_to_finding(server, f"hang-detect-{i}-{k}", extra, args.step_s)
                for k in range(args.repeats)
            ]
            times = [t for t, _ in results]
            named = sorted({who for _, who in results})
            runs = ", ".join(f"{t:.2f}" for t in times)
            median = statistics.median(times)
            print(f"{name:<42} {runs:<22} {median:>7.2f} {goal_s:>6.1f}  {'; '.join(named)}")


if __name__ == "__main__":
    main()
