"""Stepscope's CPU off the training thread, and the garbage collection its records cause.

One process per arm and round, a 1-rank gloo group pinned to one core, steps of ~10 ms of
matrix work with 6 collectives each (4 all-gathers and 2 reduce-scatters through
`torch.distributed`, waited at once: the tap's path for FSDP2's collectives), 3 sections and
`record()`, stepscope's defaults shipping to a local HTTP sink. Arms:

    plain      no stepscope (the same loop with null context managers)
    stepscope  stepscope.init() with its defaults
    breakdown  the same, with the shipper's and the watchdog's main functions timed (their
               thread's CPU inside each); its per-thread figures include that timing

Per arm, medians over rounds: each thread's CPU per step (the kernel's per-thread clocks,
summed by thread name; gloo's and torch's threads are "native"), and the garbage
collections per 1,000 steps and the time in them (`gc.callbacks`). The threads of the
local sink are left out. A 1-rank job puts no peer's wait in the collectives, so the
training thread's own figure here is not the profiler's cost in a real job
(`overhead_lockstep.py` measures that); the background threads' and the collections' are.

    flock /tmp/stepscope-bench.lock .venv/bin/python benchmarks/background_cost.py
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stepscope

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead_lockstep import threads_cpu_s  # noqa: E402
from profiler_cost import _Sink, free_port, host_speed_text  # noqa: E402

ARMS = ("plain", "stepscope", "breakdown")
NAMED_THREADS = ("training", "stepscope-shipper", "stepscope-watchdog", "native")
_WARMUP_STEPS = 100


class _NullProfiler:
    """The plain arm's stand-in: the loop's calls, doing nothing."""

    def step(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def section(self, name: str) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def record(self, **values: Any) -> None:
        return None

    def close(self) -> None:
        return None


def time_functions(totals: dict[str, float]) -> None:
    """Add each timed function's thread CPU to `totals` (by qualified name) from now on."""
    from stepscope.profiler.hangs import watchdog
    from stepscope.profiler.loop import finished
    from stepscope.profiler.shipping import shipper

    targets = [
        (finished.FinishedSteps, "ship_ready"),
        (shipper.Shipper, "_build_batches"),
        (shipper._Batch, "encoded"),
        (shipper.Shipper, "_post"),
        (watchdog.Watchdog, "_observe"),
        (watchdog.Watchdog, "_send"),
    ]
    for cls, name in targets:
        original = getattr(cls, name)
        key = f"{cls.__name__}.{name}"

        def timed(
            *args: Any, _original: Callable[..., Any] = original, _key: str = key, **kwargs: Any
        ) -> Any:
            start_s = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_key] += time.thread_time() - start_s

        setattr(cls, name, functools.wraps(original)(timed))


def arm_main(arm: str, steps: int, batch: int) -> dict[str, Any]:
    """Run one arm in this process; its figures per step."""
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    weight = torch.randn(512, 512)
    x = torch.randn(batch, 512)
    buffers = [torch.randn(4096) for _ in range(6)]
    function_s: dict[str, float] = defaultdict(float)
    if arm == "breakdown":
        time_functions(function_s)
    prof: Any = _NullProfiler()
    if arm != "plain":
        url = f"http://127.0.0.1:{sink.server_address[1]}"
        prof = stepscope.init(job_id=f"bench-background-{os.getpid()}", url=url)
        assert prof.enabled

    collections: Counter[int] = Counter()
    collection_s = [0.0]
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections[info["generation"]] += 1
            collection_s[0] += time.perf_counter() - started[0]

    def step() -> None:
        with prof.step():
            with prof.section("forward"):
                y = x @ weight @ weight
                for tensor in buffers[:4]:
                    dist.all_gather_into_tensor(torch.empty(4096), tensor)
            with prof.section("backward"):
                y = y @ weight @ weight
                for tensor in buffers[4:]:
                    dist.reduce_scatter_tensor(torch.empty(4096), tensor)
            with prof.section("optimizer"):
                y @ weight
        prof.record(samples=batch)

    for _ in range(_WARMUP_STEPS):
        step()
    function_s.clear()
    gc.callbacks.append(on_gc)
    wall_start_s, threads_start = time.perf_counter(), threads_cpu_s()
    for _ in range(steps):
        step()
    wall_s, threads_end = time.perf_counter() - wall_start_s, threads_cpu_s()
    gc.callbacks.remove(on_gc)
    prof.close()
    dist.destroy_process_group()
    per_thread_us = {
        name: (seconds - threads_start.get(name, 0.0)) / steps * 1e6
        for name, seconds in threads_end.items()
        if name in NAMED_THREADS
    }
    return {
        "step_ms": wall_s / steps * 1e3,
        "threads_us": per_thread_us,
        "collections_per_1000": {g: n / steps * 1000 for g, n in collections.items()},
        "collection_us": collection_s[0] / steps * 1e6,
        "functions_us": {name: s / steps * 1e6 for name, s in function_s.items()},
    }


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--arm", arm, "--steps", str(args.steps)]
    command += ["--batch", str(args.batch)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"arm {arm} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def median_of(results: list[dict[str, Any]], *keys: str) -> float:
    values = []
    for result in results:
        value: Any = result
        for key in keys:
            value = value.get(key, 0.0) if isinstance(value, dict) else 0.0
        values.append(float(value))
    return statistics.median(values)


def _stepscope_dir() -> str:
    """Where the arms import stepscope from (PYTHONPATH may name an export of another commit)."""
    return str(Path(stepscope.__file__).parent.parent)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=800, help="rows of the matrix work (~10 ms)")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm is not None:
        result = arm_main(args.arm, args.steps, args.batch)
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        os._exit(0)  # gloo can abort at interpreter exit

    print(
        f"1-rank gloo, {args.steps} steps of 6 collectives per arm and round, {args.rounds} "
        f"rounds, one process each; stepscope from {_stepscope_dir()}; {host_speed_text()}",
        flush=True,
    )
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for round_index in range(args.rounds):
        for arm in ARMS if round_index % 2 == 0 else reversed(ARMS):
            results[arm].append(run_arm(arm, args))
    print(f"medians over {args.rounds} rounds, µs of CPU per step unless said")
    header = f"{'arm':<10} {'step ms':>8}" + "".join(f" {n:>19}" for n in NAMED_THREADS)
    print(header + f" {'collections/1000 steps (gen 0/1/2)':>36} {'in them':>8}")
    for arm in ARMS:
        rows = results[arm]
        threads = "".join(f" {median_of(rows, 'threads_us', n):>19.1f}" for n in NAMED_THREADS)
        per_generation = "/".join(
            f"{median_of(rows, 'collections_per_1000', str(g)):.1f}" for g in range(3)
        )
        print(
            f"{arm:<10} {median_of(rows, 'step_ms'):>8.2f}{threads} {per_generation:>36} "
            f"{median_of(rows, 'collection_us'):>8.2f}"
        )
    print("inside the background threads' functions (breakdown arm):")
    for name in sorted(results["breakdown"][0]["functions_us"]):
        print(f"  {name:<32} {median_of(results['breakdown'], 'functions_us', name):7.2f}")


if __name__ == "__main__":
    main()
