"""Cost per collective call of each layer of the collective tap (profiler/collectives/tap.py).

One process, one rank of a 2-rank "fake" process group (its collectives complete at once in
the calling thread: no backend thread, so the figures are steady and the tap's own time stands
out), and a 1-rank gloo group (a real backend's Work and future, whose worker thread makes
each wait race the transfer; run in a child process of its own). The calls:

    sync           dist.all_reduce of a small tensor (ProcessGroup layer + its wait)
    async          Work.wait(dist.all_reduce(async_op=True)) (ProcessGroup layer + Work.wait)
    functional     _c10d_functional.all_reduce + wait_tensor (the BackendSelect layer)
    funcol         funcol.all_reduce(...).wait() (DTensor's path to the BackendSelect layer)
    all_gather     Work.wait(dist.all_gather_single(async_op=True)) (FSDP2's unshard)
    reduce_scatter Work.wait(dist.reduce_scatter_single(async_op=True)) (FSDP2's gradients)

Waits are `Work.wait(work)`: the fake backend's FakeWork has a wait of its own, which
`work.wait()` would reach without the class-level Work.wait wrapper. Its synchronous
all_reduce waits inside c10d through FakeWork's own wait (0 waited per call in the last
column): the tap looks at that work at the next call instead.

Arms, run in a random order in every round on the same calls:

    off            no tap
    bare           pass-through Python wrappers and kernels where the tap puts its own: the
                   floor of the mechanism (a Python frame per method call, an empty Python
                   kernel on the dispatcher per functional op)
    tap            a CollectiveTap installed directly, records appended to a list
    step           stepscope.init(patch_collectives=False): the calls inside prof.step()
    step+tap       stepscope.init() (what users get): the same, with its tap

"tap - off" is the per-layer cost, "tap - bare" the tap's own code above the floor;
"step+tap - step" is what the tap costs a user, its share of turning records into rows at step
ends included (the shipper's thread is not counted: thread CPU is the calling thread's). A
figure is the median over rounds of the paired difference to its base, µs per call, with a
bootstrap 95 % interval (wall time) and the same median in thread CPU time.

With --evict-mb N, N MB are written before every call and each call is timed alone (a
segment's figure is then its median call): what a call costs after a step's compute has
pushed the tap's (and torch's) data out of the CPU's caches, as in a training step, rather
than in a loop that keeps them there. The step arms' step boundaries are not timed then.

    flock /tmp/stepscope-bench.lock .venv/bin/python benchmarks/collective_tap.py
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import ProcessGroup, Work

import stepscope
from stepscope.profiler.collectives.calls import CollectiveCall
from stepscope.profiler.collectives.groups import GroupRegistry
from stepscope.profiler.collectives.tap import (
    FUNCOL_OPS,
    PG_METHODS,
    CollectiveTap,
)
from stepscope.profiler.timer import build_clock

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profiler_cost import _Sink, host_speed_text, median_ci  # noqa: E402

GOAL_US_PER_CALL = 5.0
ARMS = ("off", "bare", "tap", "step", "step+tap")
BASE = {"bare": "off", "tap": "off", "step+tap": "step"}
CALLS_PER_STEP = 8


def build_calls(backend: str) -> dict[str, Callable[[], Any]]:
    """The collectives to time, by name, on the default group."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    assert group is not None
    name = group.group_name
    world_size = dist.get_world_size()
    tensor = torch.ones(16)
    gathered = torch.empty(16 * world_size)
    scattered = torch.empty(16 // world_size)
    c10d = torch.ops._c10d_functional
    return {
        "sync": lambda: dist.all_reduce(tensor),
        "async": lambda: Work.wait(dist.all_reduce(tensor, async_op=True)),
        "functional": lambda: c10d.wait_tensor(c10d.all_reduce(tensor, "sum", name)),
        "funcol": lambda: funcol.all_reduce(tensor, "sum", group).wait(),
        "all_gather": lambda: Work.wait(dist.all_gather_single(gathered, tensor, async_op=True)),
        "reduce_scatter": lambda: Work.wait(
            dist.reduce_scatter_single(scattered, tensor, async_op=True)
        ),
    }


def install_bare() -> Callable[[], None]:
    """Pass-through wrappers on the methods and empty kernels on the ops the tap takes; the
    function that removes them."""
    originals = {
        name: ProcessGroup.__dict__[name] for name in PG_METHODS if name in ProcessGroup.__dict__
    }
    originals_wait = Work.__dict__["wait"]
    for name, original in originals.items():
        setattr(ProcessGroup, name, _pass_through(original))
    setattr(Work, "wait", _pass_through(originals_wait))  # noqa: B010
    library = torch.library.Library("_c10d_functional", "IMPL")
    for name in [*FUNCOL_OPS, "wait_tensor"]:
        packet = getattr(torch.ops._c10d_functional, name, None)
        if packet is not None:
            kernel = _empty_kernel(packet.default._handle.redispatch_boxed)
            library.impl(name, kernel, "BackendSelect")

    def remove() -> None:
        for name, original in originals.items():
            setattr(ProcessGroup, name, original)
        setattr(Work, "wait", originals_wait)  # noqa: B010
        library._destroy()

    return remove


def _pass_through(original: Any) -> Callable[..., Any]:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    return wrapper


def _empty_kernel(redispatch: Any) -> Callable[..., Any]:
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)  # these calls' tensors are on CPU

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return redispatch(cpu, *args, **kwargs)

    return kernel


def run_calls(one: Callable[[], Any], num_calls: int, prof: Any) -> None:
    """`num_calls` calls of `one`, CALLS_PER_STEP to a prof.step() where there is a profiler."""
    if prof is None:
        for _ in range(num_calls):
            one()
    else:
        for _ in range(num_calls // CALLS_PER_STEP):
            with prof.step():
                for _ in range(CALLS_PER_STEP):
                    one()


def evicted_calls(
    call: Callable[[], Any], num_calls: int, evict: torch.Tensor, prof: Any
) -> tuple[float, float]:
    """`num_calls` times the median wall and thread-CPU seconds of a call timed alone right
    after `evict` is written: the caches hold a step's data, not the tap's (or torch's)."""
    walls_s: list[float] = []
    cpus_s: list[float] = []

    def one() -> None:
        evict.add_(1.0)
        wall_start_s, cpu_start_s = time.perf_counter(), time.thread_time()
        call()
        walls_s.append(time.perf_counter() - wall_start_s)
        cpus_s.append(time.thread_time() - cpu_start_s)

    run_calls(one, num_calls, prof)
    return num_calls * statistics.median(walls_s), num_calls * statistics.median(cpus_s)


def segment(
    arm: str, call: Callable[[], Any], num_calls: int, url: str, evict: torch.Tensor | None
) -> tuple[float, float, int, int]:
    """Wall and thread-CPU seconds of `num_calls` calls under `arm`; calls recorded, and how many
    of them were waited on."""
    records: list[CollectiveCall] = []
    tap = None
    remove_bare = None
    prof: Any = None
    if arm == "bare":
        remove_bare = install_bare()
    elif arm == "tap":
        tap = CollectiveTap(clock=build_clock("cpu"), calls=records, groups=GroupRegistry())
        tap.install()
    elif arm.startswith("step"):
        # The fake backend's works never complete (FakeWork.wait is its own): don't wait at close.
        prof = stepscope.init(
            job_id="bench-tap", url=url, patch_collectives=arm == "step+tap", close_timeout_s=0.0
        )
        assert prof.enabled
    if evict is not None:
        wall_s, cpu_s = evicted_calls(call, num_calls, evict, prof)
    else:
        wall_start_s, cpu_start_s = time.perf_counter(), time.thread_time()
        run_calls(call, num_calls, prof)
        wall_s, cpu_s = time.perf_counter() - wall_start_s, time.thread_time() - cpu_start_s
    if remove_bare is not None:
        remove_bare()
    if tap is not None:
        tap.remove()
    if prof is not None:
        prof.close()
    return wall_s, cpu_s, len(records), sum(r.wait_s > 0 for r in records)


def measure(backend: str, args: Any, url: str, queue: Any) -> None:
    """Every call under every arm, interleaved rounds; per-call seconds put on `queue`."""
    torch.set_num_threads(1)
    # close_timeout_s=0 leaves the step arms' rows unsent: each close would warn of it.
    logging.getLogger("stepscope").setLevel(logging.ERROR)
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    calls = build_calls(backend)
    evict = torch.zeros(args.evict_mb * 2**18) if args.evict_mb else None  # 4-byte floats
    rng = random.Random(args.seed)
    wall_s: dict[str, dict[str, list[float]]] = {c: {a: [] for a in ARMS} for c in calls}
    cpu_s: dict[str, dict[str, list[float]]] = {c: {a: [] for a in ARMS} for c in calls}
    seen: dict[str, tuple[int, int]] = {}
    for round_index in range(args.warmup_rounds + args.rounds):
        for name, call in calls.items():
            for arm in rng.sample(ARMS, len(ARMS)):
                wall, cpu, num_records, num_waits = segment(arm, call, args.calls, url, evict)
                if round_index < args.warmup_rounds:
                    continue
                wall_s[name][arm].append(wall / args.calls)
                cpu_s[name][arm].append(cpu / args.calls)
                if arm == "tap":
                    seen[name] = (num_records, num_waits)
    queue.put({"wall_s": wall_s, "cpu_s": cpu_s, "seen": seen})
    dist.destroy_process_group()


def run_backend(backend: str, args: Any, url: str) -> dict[str, Any]:
    """measure() in a fresh process (one default group per process)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=measure, args=(backend, args, url, queue))
    proc.start()
    result: dict[str, Any] = queue.get(timeout=3600)
    proc.join(60)
    return result


def delta_text(values: dict[str, list[float]], arm: str) -> tuple[str, float]:
    deltas = [(t - b) * 1e6 for t, b in zip(values[arm], values[BASE[arm]], strict=True)]
    median, low, high = median_ci(deltas)
    return f"{median:+.2f} [{low:+.2f} .. {high:+.2f}]", median


def print_backend(backend: str, result: dict[str, Any], num_calls: int) -> dict[str, list[str]]:
    """The table of one backend; by arm, the calls whose CPU cost misses the goal."""
    wall_s, cpu_s = result["wall_s"], result["cpu_s"]
    print(
        f"\n{backend}: us per call, median over rounds of the paired difference [95 % CI]; "
        f"{num_calls} calls per segment"
    )
    print(
        f"{'call':15} {'off':>6} {'bare-off':>8} {'tap - off: wall':>27} {'CPU':>7} "
        f"{'tap-bare':>8}   {'step+tap - step: wall':>27} {'CPU':>7}   recorded/waited per call"
    )
    missed: dict[str, list[str]] = {"tap": [], "step+tap": []}
    for name in wall_s:
        off_us = statistics.median(wall_s[name]["off"]) * 1e6
        _, bare = delta_text(cpu_s[name], "bare")
        cells = []
        for arm in ("tap", "step+tap"):
            wall, _ = delta_text(wall_s[name], arm)
            _, cpu = delta_text(cpu_s[name], arm)
            cells.append(f"{wall:>27} {cpu:+7.2f}")
            if cpu > GOAL_US_PER_CALL:
                missed[arm].append(name)
        own = statistics.median(
            (t - b) * 1e6 for t, b in zip(cpu_s[name]["tap"], cpu_s[name]["bare"], strict=True)
        )
        num_records, num_waits = result["seen"][name]
        print(
            f"{name:15} {off_us:6.1f} {bare:+8.2f} {cells[0]} {own:+8.2f}   {cells[1]}   "
            f"{num_records / num_calls:.2f}/{num_waits / num_calls:.2f}"
        )
    return missed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=None, help="20, or 5 with --quick")
    p.add_argument("--warmup-rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000, help="calls per segment")
    p.add_argument("--backends", default="fake,gloo", help="comma-separated")
    p.add_argument("--quick", action="store_true", help="400 calls per segment, 1 warm-up round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--evict-mb",
        type=int,
        default=0,
        help="write this many MB before each call and time each call alone (0: warm loop)",
    )
    args = p.parse_args()
    if args.quick:
        args.warmup_rounds, args.calls = 1, 400
    args.rounds = args.rounds or (5 if args.quick else 20)
    args.calls -= args.calls % CALLS_PER_STEP
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    print(
        f"Collective tap cost per call: {args.rounds} rounds x {len(ARMS)} arms, random order; "
        f"the step arms issue {CALLS_PER_STEP} calls per prof.step(); {host_speed_text()}"
    )
    if args.evict_mb:
        print(f"each call timed alone, after {args.evict_mb} MB were written (caches evicted)")
    for backend in args.backends.split(","):
        missed = print_backend(backend, run_backend(backend, args, url), args.calls)
        for arm, names in missed.items():
            verdict = "met" if not names else f"NOT met by {', '.join(names)}"
            print(f"goal <= {GOAL_US_PER_CALL:.0f} us CPU per call, {arm}: {verdict}")


if __name__ == "__main__":
    main()
