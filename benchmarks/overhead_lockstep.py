"""Stepscope's CPU cost per step with no spare core for its threads: two jobs in lock-step.

Two 2-rank gloo jobs of the same model (DDP or FSDP2, profiler_overhead.py's ~10 ms
steps) run at once, rank r of each pinned to CPU core r; they take turns, one step each:
job X steps, hands the turn to job Y, and so on (a semaphore per rank and job). So every
step of one job has the same machine as the step of the other job just before it: the
machine's slow swings, which move a 300-step launch's mean by several %, hit both alike.
A cycle's CPU of a job is its process's CPU time (every thread: the shipper, the watchdog,
gloo's) from the start of one of its steps to the start of its next one. The jobs' threads
share each core with the other job's, so what stepscope's threads spend is on the core
the training needs: the cost where no core is spare.

Per parallelism, each round runs three launches in a random order:

    x    job X under stepscope.init(model=...) (defaults, step/sections/record/loader),
         job Y plain
    y    the same with the roles swapped (the two orders' mean cancels what going
         first or second does)
    a/a  both plain: the control

A launch's overhead is the mean over cycles of profiled - plain CPU, over the plain job's
mean cycle CPU; a round's is the mean of its x and y launches. The figures are medians over
rounds with a bootstrap 95 % interval, the A/A's beside them. Each thread's CPU per step
(profiled - plain, µs; from the kernel's per-thread clocks) is printed beside, by name: the
training thread, stepscope's shipper and watchdog, and the rest ("native": gloo's, which use
several ms a step and swing by ~1 % of the step between launches). The training thread and
stepscope's threads together, gloo's left out, are a second verdict: narrower, blind to what
stepscope makes gloo's threads spend. These per-thread figures are taken from step 1/10 to
the last, and their medians and intervals are over launches (x and y each count once), not
over rounds.

With `--instrument floor` the profiled job runs under floor_instrumentation.py instead:
clock reads at stepscope's entry points and on every collective, one tuple each, dropped
every step (`floor-kept`: kept 200 steps, as long as stepscope keeps its records), no
threads. What that adds is the floor any Python profiler of this loop pays
here; what stepscope adds above it is its own.

    flock /tmp/stepscope-bench.lock .venv/bin/python benchmarks/overhead_lockstep.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stepscope

sys.path.insert(0, str(Path(__file__).resolve().parent))

from floor_instrumentation import FloorProfiler  # noqa: E402
from profiler_cost import (  # noqa: E402
    GOAL_OVERHEAD_PCT,
    _Sink,
    build_model,
    free_port,
    host_speed_text,
    median_ci,
    plain_segment,
    profiled_segment,
)
from profiler_overhead import verdict, wrap  # noqa: E402

WORLD_SIZE = 2
JOBS = ("X", "Y")
OTHER = {"X": "Y", "Y": "X"}
LAUNCHES = {"x": "X", "y": "Y", "a/a": None}
"""Launch → the job that runs under stepscope."""
SHAPES = {"ddp": (512, 3, 250), "fsdp2": (256, 1, 896)}
"""(width, depth, batch) for a step of ~10 ms of CPU: DDP's took 11.1 ms on a host that runs
10^6 Python additions in ~23 ms, but 14.9 ms on one at 19 ms with slower matrix work (there
--ddp-batch 165 gave 11.4 ms); FSDP2's took 9.95 ms on the latter. FSDP2's model stays small:
most of its step is gloo's threads (~5 ms), and a wider model made their CPU swing by several
% between launches; its batch adds the compute (at batch 32 the step took ~7.5 ms, ~2 ms of it
in the training thread)."""
OWN = "stepscope's and the training thread"
"""Key of the sum of every thread's difference but gloo's ("native"), in % of the step..."""
OWN_US = "the same in µs"
"""...and in µs per step."""


Shape = tuple[int, int, int]


def rank_main(
    rank: int,
    job: str,
    parallel: str,
    shape: Shape,
    instrument: str | None,
    steps: int,
    port: int,
    url: str,
    turns: Any,
) -> None:
    """Train `steps` steps of one job's rank, each when it has the turn, under `instrument`
    ("stepscope", "floor", "floor-kept", or None: plain); its process and training-thread CPU
    times at every step start go on turns["out"]."""
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})  # before gloo starts its threads
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    width, depth, batch = shape
    model = wrap(build_model(width, depth), parallel)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(batch, width, generator=gen) for _ in range(64)]
    batches = [(x, x.sum(dim=1, keepdim=True)) for x in xs]

    mine, other = turns[(job, rank)], turns[(OTHER[job], rank)]
    cpu_s: list[tuple[float, float]] = []
    threads_at: list[dict[str, float]] = []

    def in_turn() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches, each once this rank has the turn; the turn passes when the step
        that took it is done (the next batch is asked for)."""
        for index in range(steps):
            mine.acquire()
            cpu_s.append((time.process_time(), time.thread_time()))
            if index in (steps // 10, steps - 1):
                threads_at.append(threads_cpu_s())
            yield batches[index % len(batches)]
            other.release()

    dist.barrier()
    prof = None
    if instrument == "stepscope":
        prof = stepscope.init(job_id=f"bench-lockstep-{port}", url=url, model=model)
        assert prof.enabled
        profiled_segment(model, opt, in_turn(), prof)
    elif instrument in ("floor", "floor-kept"):
        # floor-kept: the tuples of 200 steps (~2 s, stepscope's flush interval) kept
        floor = FloorProfiler(keep_steps=200 if instrument == "floor-kept" else 0)
        floor.install_tap()
        profiled_segment(model, opt, in_turn(), floor)
    else:
        plain_segment(model, opt, in_turn())
    first, last = threads_at
    per_thread = {
        name: (last[name] - first.get(name, 0.0)) / (steps - 1 - steps // 10) for name in last
    }
    turns["out"].put((job, rank, cpu_s, per_thread))
    turns["out"].close()
    turns["out"].join_thread()  # sent before os._exit below
    if prof is not None:
        prof.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort at interpreter exit


def threads_cpu_s() -> dict[str, float]:
    """Every thread's CPU so far, seconds (the kernel's ns clock), summed by name: the training
    thread, stepscope's threads by their names, the rest (gloo's, torch's) as "native"."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "training"
    totals: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                ns = int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended
            continue
        name = names.get(int(tid), "native")
        totals[name] = totals.get(name, 0.0) + ns / 1e9
    return totals


Cycles = dict[tuple[str, int], list[float]]
"""(job, 0: the process or 1: its training thread) → each cycle's CPU, seconds, the ranks' mean."""


def launch(
    parallel: str, shape: Shape, profiled_job: str | None, steps: int, url: str, instrument: str
) -> tuple[Cycles, dict[str, dict[str, float]]]:
    """Both jobs in lock-step; per job, each cycle's process and training-thread CPU, and
    its threads' CPU per step by name (the ranks' mean, seconds)."""
    ctx = mp.get_context("fork")  # the parent has imported torch but run no torch op
    turns: dict[Any, Any] = {
        (job, rank): ctx.Semaphore(0) for job in JOBS for rank in range(WORLD_SIZE)
    }
    turns["out"] = ctx.Queue()
    for rank in range(WORLD_SIZE):
        turns[("X", rank)].release()  # X steps first
    procs = []
    for job in JOBS:
        port = free_port()
        for rank in range(WORLD_SIZE):
            chosen = instrument if job == profiled_job else None
            args = (rank, job, parallel, shape, chosen, steps, port, url, turns)
            procs.append(ctx.Process(target=rank_main, args=args))
    for proc in procs:
        proc.start()
    starts: dict[tuple[str, int], list[tuple[float, float]]] = {}
    threads: dict[str, dict[str, float]] = {}
    for _ in procs:
        job, rank, cpu_s, per_thread = turns["out"].get(timeout=1800)
        starts[(job, rank)] = cpu_s
        for name, seconds in per_thread.items():
            job_threads = threads.setdefault(job, {})
            job_threads[name] = job_threads.get(name, 0.0) + seconds / WORLD_SIZE
    for proc in procs:
        proc.join(120)
    cycles = {}
    for job in JOBS:
        for clock in (0, 1):
            per_rank = [
                [b[clock] - a[clock] for a, b in pairwise(starts[(job, r)])]
                for r in range(WORLD_SIZE)
            ]
            cycles[(job, clock)] = [statistics.fmean(pair) for pair in zip(*per_rank, strict=True)]
    return cycles, threads


def thread_difference_us(
    threads: dict[str, dict[str, float]], profiled_job: str | None
) -> dict[str, float]:
    """Per thread name, the profiled job's CPU per step less the plain one's, µs."""
    profiled, plain = threads[profiled_job or "Y"], threads[OTHER[profiled_job or "Y"]]
    return {
        name: (profiled.get(name, 0.0) - plain.get(name, 0.0)) * 1e6
        for name in sorted(profiled.keys() | plain.keys())
    }


def compare(cycles: Cycles, profiled_job: str | None, warmup: int) -> tuple[float, float, float]:
    """The profiled job's mean cycle CPU over the plain one's, in % above it (a/a: Y's over
    X's), the plain job's mean cycle CPU in ms, and the training thread's difference in µs."""
    profiled_job = profiled_job or "Y"
    profiled, plain, thread_profiled, thread_plain = (
        statistics.fmean(cycles[(job, clock)][warmup:])
        for clock in (0, 1)
        for job in (profiled_job, OTHER[profiled_job])
    )
    return (profiled / plain - 1) * 100, plain * 1e3, (thread_profiled - thread_plain) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=1500, help="steps of each job per launch")
    p.add_argument("--parallel", default="ddp,fsdp2", help="comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ddp-batch", type=int, default=SHAPES["ddp"][2], help="for a ~10 ms step")
    p.add_argument("--fsdp2-batch", type=int, default=SHAPES["fsdp2"][2], help="the same")
    p.add_argument(
        "--instrument",
        choices=("stepscope", "floor", "floor-kept"),
        default="stepscope",
        help="what the profiled job runs under; floor: floor_instrumentation.py's clock reads",
    )
    args = p.parse_args()
    batches = {"ddp": args.ddp_batch, "fsdp2": args.fsdp2_batch}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    warmup = args.steps // 10
    rng = random.Random(args.seed)
    print(
        f"Two 2-rank gloo jobs in lock-step, rank r of both on core r; {args.rounds} rounds of "
        f"launches x, y, a/a in a random order; {args.steps} steps per job and launch, the "
        f"first {warmup} discarded. Process CPU per cycle, profiled job over plain job; "
        f"{host_speed_text()}:"
    )
    for parallel in args.parallel.split(","):
        width, depth, _ = SHAPES[parallel]
        shape = (width, depth, batches[parallel])
        rounds: list[dict[str, float]] = []
        threads: list[dict[str, float]] = []
        by_name: dict[str, dict[str, list[float]]] = {"profiled": {}, "a/a": {}}
        cycle_ms: list[float] = []
        for index in range(args.rounds):
            figures, thread_us = {}, {}
            for name in rng.sample(list(LAUNCHES), len(LAUNCHES)):
                cycles, per_thread = launch(
                    parallel, shape, LAUNCHES[name], args.steps, url, args.instrument
                )
                figures[name], plain_ms, thread_us[name] = compare(cycles, LAUNCHES[name], warmup)
                cycle_ms.append(plain_ms)
                arm = by_name["a/a" if name == "a/a" else "profiled"]
                differences = thread_difference_us(per_thread, LAUNCHES[name])
                for thread_name, us in differences.items():
                    arm.setdefault(thread_name, []).append(us)
                own = sum(us for thread_name, us in differences.items() if thread_name != "native")
                arm.setdefault(OWN, []).append(own / (plain_ms * 1e3) * 100)
                arm.setdefault(OWN_US, []).append(own)
            rounds.append(figures)
            threads.append(thread_us)
            print(
                f"  {parallel} round {index + 1}: x {figures['x']:+.2f} %, y {figures['y']:+.2f} %,"
                f" a/a {figures['a/a']:+.2f} %; training thread x {thread_us['x']:+.1f} µs, "
                f"y {thread_us['y']:+.1f} µs, a/a {thread_us['a/a']:+.1f} µs",
                flush=True,
            )
        both = [(r["x"] + r["y"]) / 2 for r in rounds]
        median, low, high = median_ci(both)
        aa, aa_low, aa_high = median_ci([r["a/a"] for r in rounds])
        print(
            f"{parallel.upper()} CPU per step, no spare core: {median:+.2f} % [95 % CI "
            f"{low:+.2f} .. {high:+.2f}] of the plain job's {statistics.median(cycle_ms):.2f} ms; "
            f"A/A {aa:+.2f} % [{aa_low:+.2f} .. {aa_high:+.2f}]; goal <= "
            f"{GOAL_OVERHEAD_PCT:.0f} %: {verdict(median, high, aa_low, aa_high)}",
            flush=True,
        )
        thread, thread_low, thread_high = median_ci([(t["x"] + t["y"]) / 2 for t in threads])
        thread_aa, thread_aa_low, thread_aa_high = median_ci([t["a/a"] for t in threads])
        print(
            f"{parallel.upper()} of which the training thread: {thread:+.1f} µs per step [95 % CI "
            f"{thread_low:+.1f} .. {thread_high:+.1f}]; A/A {thread_aa:+.1f} µs "
            f"[{thread_aa_low:+.1f} .. {thread_aa_high:+.1f}]",
            flush=True,
        )
        own, own_low, own_high = median_ci(by_name["profiled"].pop(OWN))
        own_aa, own_aa_low, own_aa_high = median_ci(by_name["a/a"].pop(OWN))
        own_us, own_us_low, own_us_high = median_ci(by_name["profiled"].pop(OWN_US))
        by_name["a/a"].pop(OWN_US)
        print(
            f"{parallel.upper()} the training thread and stepscope's threads, gloo's left out: "
            f"{own:+.2f} % [95 % CI {own_low:+.2f} .. {own_high:+.2f}]; A/A {own_aa:+.2f} % "
            f"[{own_aa_low:+.2f} .. {own_aa_high:+.2f}]; goal <= {GOAL_OVERHEAD_PCT:.0f} %: "
            f"{verdict(own, own_high, own_aa_low, own_aa_high)}; that is {own_us:+.1f} µs per "
            f"step [{own_us_low:+.1f} .. {own_us_high:+.1f}], {own_us / 100:+.2f} % of a 10 ms "
            "step",
            flush=True,
        )
        for name in sorted(by_name["profiled"].keys() - {"training"}):  # printed above
            median, low, high = median_ci(by_name["profiled"][name])
            aa = statistics.median(by_name["a/a"].get(name, [0.0]))
            print(
                f"{parallel.upper()}   thread {name}: {median:+.1f} µs per step [95 % CI "
                f"{low:+.1f} .. {high:+.1f}]; A/A {aa:+.1f} µs",
                flush=True,
            )


if __name__ == "__main__":
    main()
