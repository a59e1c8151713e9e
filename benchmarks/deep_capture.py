"""Deep capture (#21): the step time of a job outside its captured steps, with a capture
and without, each launch a process of its own, against a real `stepscope serve`.

A launch trains a small CPU MLP (a few ms a step at the default width, one torch
thread) with stepscope for --steps steps and writes each step's wall time (its own
perf_counter around the whole iteration). Modes:

    off        stepscope with capture=False (the server's requests are ignored)
    off_b      the same again: the A/A control, whose "difference" is the noise
    capture    stepscope with captures on; the benchmark asks the server for a capture of
               --capture-steps steps of the launch's rank 0 as soon as it has sent a batch

Rounds launch the three in a random order. Per launch: the median step time outside the
captured steps (and one step either side), the captured steps' median and the step that
stopped the profiler (its stop runs in the training thread, after the step's own time but
inside this loop's iteration). The goal: outside the captured steps, capture/off within the
A/A noise.

    nice -n 19 .venv/bin/python benchmarks/deep_capture.py [--rounds 3] [--steps 400]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MODES = ("off", "off_b", "capture")


def train(out: Path, *, mode: str, steps: int, width: int) -> None:
    """The launched process: train and write the step times."""
    import torch
    from torch import nn

    import stepscope

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = stepscope.init(flush_interval_s=0.2, capture=mode == "capture")
    x = torch.randn(64, width)
    times_s = []
    for _ in range(steps):
        start = time.perf_counter()
        with prof.step():
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        times_s.append(time.perf_counter() - start)
    prof.close()
    out.write_text(json.dumps(times_s))


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def post(url: str, doc: dict[str, Any]) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def launch(url: str, job_id: str, mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One launch; its step times and, with a capture, the captured steps."""
    out = tmp / f"{job_id}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    env.update(STEPSCOPE_URL=url, STEPSCOPE_JOB_ID=job_id, OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--train", str(out), "--mode", mode]
    cmd += ["--steps", str(args.steps), "--width", str(args.width)]
    proc = subprocess.Popen(cmd, env=env)
    captured: dict[str, Any] | None = None
    if mode == "capture":
        api = f"{url}/api/v1/jobs/{job_id}"
        while proc.poll() is None:  # ask once the job's first steps are stored
            status = post(f"{api}/captures", {"rank": 0, "num_steps": args.capture_steps})
            if status == 201:
                break
            time.sleep(0.2)
    proc.wait(timeout=600)
    times_s = json.loads(out.read_text())
    if mode == "capture":
        [request] = get(f"{url}/api/v1/jobs/{job_id}/captures")
        [captured] = request["captures"]
    return {"times_s": times_s, "capture": captured}


def figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Median step time outside the captured steps (±1), in them, and the stopping step."""
    times_s, capture = result["times_s"], result["capture"]
    if capture is None or capture.get("first_step") is None:
        return {"outside_s": statistics.median(times_s[20:]), "inside_s": None, "stop_s": None}
    first, last = capture["first_step"], capture["last_step"]
    outside = [t for i, t in enumerate(times_s) if i >= 20 and not first - 1 <= i <= last + 1]
    return {
        "outside_s": statistics.median(outside),
        "inside_s": statistics.median(times_s[first:last]),  # the last holds the stop
        "stop_s": times_s[last],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--capture-steps", type=int, default=5)
    parser.add_argument("--train", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="off", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train is not None:
        train(args.train, mode=args.mode, steps=args.steps, width=args.width)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.live_server import run_server

    rng = random.Random(0)
    per_mode: dict[str, list[dict[str, float | None]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp, run_server() as server:
        for round_index in range(args.rounds):
            for mode in rng.sample(MODES, len(MODES)):
                job_id = f"bench-capture-{round_index}-{mode}"
                result = launch(server.url, job_id, mode, args, Path(tmp))
                per_mode[mode].append(figures(result))
                if mode == "capture":
                    c = result["capture"]
                    print(
                        f"round {round_index}: capture {c['status']}, steps "
                        f"{c['first_step']}-{c['last_step']}, {c['trace_bytes'] or 0:,} bytes"
                    )
    print(f"\nstep time, median over {args.rounds} launches of each launch's median (ms):")
    print(f"{'mode':<10} {'outside captured':>17} {'captured':>10} {'stopping step':>14}")
    for mode in MODES:
        rows = per_mode[mode]

        def med(key: str, rows: list[dict[str, float | None]] = rows) -> str:
            values = [r[key] for r in rows if r[key] is not None]
            return f"{statistics.median(values) * 1e3:.2f}" if values else "–"

        print(f"{mode:<10} {med('outside_s'):>17} {med('inside_s'):>10} {med('stop_s'):>14}")

    def outside(mode: str) -> float:
        return statistics.median(float(r["outside_s"] or 0.0) for r in per_mode[mode])

    off, off_b, on = outside("off"), outside("off_b"), outside("capture")
    print(
        f"\noutside the captured steps: capture/off {on / off - 1:+.1%}; "
        f"A/A noise off_b/off {off_b / off - 1:+.1%} (goal: capture/off within the noise)"
    )


if __name__ == "__main__":
    main()
