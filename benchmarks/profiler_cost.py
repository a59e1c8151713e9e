"""The profiler's cost per step, in one process: a tiny and a ~10 ms CPU DDP step, five modes.

Profiling and plain models share each rank's process here, so the profiler's background
threads cost every mode alike; profiler_overhead.py measures the overhead with and without
stepscope in separate processes (DDP and FSDP2). Two gloo ranks (torch.multiprocessing,
one torch thread each) hold identical DDP models (same seed) and train them in short
interleaved segments on the same batches:

    plain            DDP as is
    plain_b          a second plain model: the A/A control, its "overhead" is the noise
    profiled         DDP watched by stepscope with its defaults (comm_timing="step"), with
                     step/sections/record/wrapped loader, shipping to a collector
    profiled_bucket  the same with comm_timing="bucket" (a comm hook timing every bucket)
    bare_hook        DDP + the cheapest Python comm hook that keeps DDP's arithmetic
                     (scale, all-reduce, one future callback): the floor of any bucket hook

Each round runs one segment of every mode on the same batches, in a random order (the
same on both ranks) so that no mode always follows another. A round's step time of a
mode is the median of its segment's steps, averaged over the two ranks (they wait for
each other at every all-reduce, so they are one measurement). Two phases:

1. Cost per step: a tiny model (a ~0.8 ms step) makes the profiler's fixed per-step cost
   stand out of the noise: the median over rounds of the paired difference mode - plain,
   in µs, with a bootstrap 95 % interval.
2. The ~10 ms step: the median paired ratio mode/plain, its bootstrap 95 % interval and
   the IQR of the ratios (the wall-time noise of this shared 2-core machine is several %).

The overhead is the cost of phase 1 over the plain step of phase 2; phase 2's direct ratio
is printed next to it. CPU time per step (median paired difference to plain) says where
the cost is: the training thread's, and the whole process's (shipper threads and gloo's
too, whichever mode is running). Wire bytes are the gzipped request bodies the collector
acknowledged, per rank-step (a local HTTP sink, or a real collector with --url).

    flock /tmp/stepscope-bench.lock .venv/bin/python benchmarks/profiler_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import stepscope

MODES = ("plain", "plain_b", "profiled", "profiled_bucket", "bare_hook")
PROFILED = {"profiled": "step", "profiled_bucket": "bucket"}
"""Profiled modes and their comm_timing."""
ABOUT = {
    "plain": "DDP, no hook",
    "plain_b": "A/A control: a second plain model",
    "profiled": 'full profiler, comm_timing="step" (the default)',
    "profiled_bucket": 'full profiler, comm_timing="bucket"',
    "bare_hook": "minimal Python comm hook (floor of any bucket hook)",
}
GOAL_OVERHEAD_PCT = 1.0
GOAL_WIRE_BYTES = 3072


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps connections open, as the collector (uvicorn) does
    disable_nagle_algorithm = True  # as uvicorn: else each answer's body waits ~40 ms

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"accepted":{},"duplicate":false}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@dataclass(frozen=True)
class Shape:
    """The model and segment length of one phase."""

    width: int
    depth: int
    batch: int
    steps: int
    rounds: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


_BARE_OPTS = dist.AllreduceOptions()
_BARE_OPTS.asyncOp = True


def bare_hook(process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """What any Python comm hook must do to keep DDP's result: scale, all-reduce, a callback."""
    group: Any = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.mul_(1.0 / group.size())
    return group.allreduce([tensor], _BARE_OPTS).get_future().then(lambda fut: fut.value()[0])


bare_hook.__annotations__ = {
    "process_group": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def plain_segment(
    ddp: nn.Module, opt: torch.optim.Optimizer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> list[float]:
    """Step times of a segment without the profiler, seconds."""
    times_s = []
    start = time.perf_counter()
    for x, y in batches:
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end = time.perf_counter()
        times_s.append(end - start)
        start = end
    return times_s


def profiled_segment(
    ddp: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    prof: stepscope.Profiler,
) -> list[float]:
    """Step times of a segment with the profiler (its loader wait included), seconds."""
    times_s = []
    start = time.perf_counter()
    data: Iterable[tuple[torch.Tensor, torch.Tensor]] = prof.wrap_dataloader(batches)
    for x, y in data:
        with prof.step():
            with prof.section("forward"):
                loss = nn.functional.mse_loss(ddp(x), y)
            with prof.section("backward"):
                loss.backward()
            with prof.section("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            prof.record(samples=x.shape[0])
        end = time.perf_counter()
        times_s.append(end - start)
        start = end
    return times_s


def worker(
    rank: int, world_size: int, port: int, url: str, args: Any, shape: Shape, queue: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    models = {
        mode: DistributedDataParallel(build_model(shape.width, shape.depth)) for mode in MODES
    }
    models["bare_hook"].register_comm_hook(None, bare_hook)
    opts = {mode: torch.optim.SGD(m.parameters(), lr=1e-4) for mode, m in models.items()}
    profilers = {
        mode: stepscope.init(
            job_id=f"{args.job_id}-{comm_timing}",
            url=url,
            model=models[mode],
            comm_timing=comm_timing,
            patch_collectives=mode == "profiled",
        )
        for mode, comm_timing in PROFILED.items()
    }
    assert all(prof.enabled for prof in profilers.values())
    gen = torch.Generator().manual_seed(rank)
    order_rng = random.Random(args.seed)  # the same orders on every rank
    times_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    process_cpu_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    dist.barrier()
    for round_index in range(args.warmup_rounds + shape.rounds):
        xs = [torch.randn(shape.batch, shape.width, generator=gen) for _ in range(shape.steps)]
        batches = [(x, x.sum(dim=1, keepdim=True)) for x in xs]
        for mode in order_rng.sample(MODES, len(MODES)):
            cpu_start_s = time.thread_time()
            process_start_s = time.process_time()
            if mode in profilers:
                steps_s = profiled_segment(models[mode], opts[mode], batches, profilers[mode])
            else:
                steps_s = plain_segment(models[mode], opts[mode], batches)
            if round_index >= args.warmup_rounds:
                times_s[mode].append(statistics.median(steps_s))
                cpu_s[mode].append((time.thread_time() - cpu_start_s) / len(steps_s))
                process_cpu_s[mode].append((time.process_time() - process_start_s) / len(steps_s))
    for prof in profilers.values():
        prof.close()
    stats = profilers["profiled"].shipper.stats  # type: ignore[attr-defined]
    queue.put(
        {
            "rank": rank,
            "times_s": times_s,
            "cpu_s": cpu_s,
            "process_cpu_s": process_cpu_s,
            "bytes_sent": stats.num_bytes_sent,
            "steps_sent": stats.num_rows_sent["steps"],
            "rows_sent": dict(stats.num_rows_sent),
            "batches_sent": stats.num_batches_sent,
        }
    )
    dist.barrier()
    dist.destroy_process_group()


def hot_path_us(url: str, num_steps: int = 20_000) -> float:
    """CPU time of the profiler's per-step calls alone (step, 3 sections, record, next()), µs."""
    prof = stepscope.init(job_id="bench-hot-path", url=url)
    items = prof.wrap_dataloader(range(num_steps))
    start = time.process_time()
    for _ in items:
        with prof.step():
            with prof.section("forward"):
                pass
            with prof.section("backward"):
                pass
            with prof.section("optimizer"):
                pass
            prof.record(samples=64)
    elapsed_s = time.process_time() - start
    prof.close()
    return elapsed_s / num_steps * 1e6


def paced_shipper_us(url: str, *, step_s: float = 0.01, num_steps: int = 600) -> float:
    """CPU time of the shipper thread per step when steps take `step_s` (its default flush
    interval then batches 200 steps), µs."""
    prof = stepscope.init(job_id="bench-paced-shipper", url=url)
    for _ in range(num_steps):
        with prof.step():
            time.sleep(step_s)
        prof.record(samples=64)
    prof.close()
    stats = prof.shipper.stats  # type: ignore[attr-defined]
    return float(stats.thread_cpu_s) / num_steps * 1e6


def host_speed_text() -> str:
    """How fast this machine runs Python, to read the µs figures by (they scale with it): the
    fastest of three loops of 10⁶ additions."""
    times_ms = []
    for _ in range(3):
        start = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i
        times_ms.append((time.perf_counter() - start) * 1e3)
    return f"this host: 10^6 Python additions in {min(times_ms):.0f} ms"


def median_ci(values: list[float], *, num_resamples: int = 2000) -> tuple[float, float, float]:
    """Median of `values` and its bootstrap 95 % interval."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(num_resamples)
    )
    low, high = medians[int(0.025 * num_resamples)], medians[int(0.975 * num_resamples) - 1]
    return statistics.median(values), low, high


def run_ranks(url: str, args: Any, shape: Shape) -> list[dict[str, Any]]:
    """Run both ranks on one model shape; their results, by rank."""
    world_size = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=worker, args=(rank, world_size, port, url, args, shape, queue))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(60)
    return results


class Phase:
    """Per-round step times of every mode (both ranks averaged), and CPU times per rank."""

    def __init__(self, results: list[dict[str, Any]]) -> None:
        self.results = results
        # The ranks are synchronised by every all-reduce: one time per round, their mean.
        self.per_round_s = {
            mode: [
                statistics.mean(ts)
                for ts in zip(*(r["times_s"][mode] for r in results), strict=True)
            ]
            for mode in MODES
        }

    def median_ms(self, mode: str) -> float:
        return statistics.median(self.per_round_s[mode]) * 1e3

    def ratios(self, mode: str) -> list[float]:
        base = self.per_round_s["plain"]
        return [t / b for t, b in zip(self.per_round_s[mode], base, strict=True)]

    def wall_us(self, mode: str) -> list[float]:
        base = self.per_round_s["plain"]
        return [(t - b) * 1e6 for t, b in zip(self.per_round_s[mode], base, strict=True)]

    def cpu_us(self, mode: str, key: str) -> float:
        """Median paired difference of CPU per step to plain, both ranks."""
        return statistics.median(
            (t - b) * 1e6
            for r in self.results
            for t, b in zip(r[key][mode], r[key]["plain"], strict=True)
        )

    def cpu_columns(self, mode: str) -> str:
        return f"{self.cpu_us(mode, 'cpu_s'):+.0f}, {self.cpu_us(mode, 'process_cpu_s'):+.0f}"


def print_table(
    phase: Phase,
    *,
    step_header: str,
    step: Callable[[str], str],
    wall_header: str,
    wall: Callable[[str], str],
) -> None:
    """One line per mode: its step time, its wall time against plain, its CPU against plain."""
    print(
        f"{'mode':15} {step_header:>7}  {wall_header:52} "
        f"{'CPU us/step vs plain: thread, process':>37}"
    )
    for mode in MODES:
        against = ("", "") if mode == "plain" else (wall(mode), phase.cpu_columns(mode))
        print(f"{mode:15} {step(mode):>7}  {against[0]:52} {against[1]:>37}   {ABOUT[mode]}")


def cost_text(phase: Phase, mode: str) -> str:
    median, low, high = median_ci(phase.wall_us(mode))
    return f"{median:+.1f}  [{low:+.1f} .. {high:+.1f}]"


def ratio_text(phase: Phase, mode: str) -> str:
    ratios = phase.ratios(mode)
    median, low, high = median_ci(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return f"{pct(median)} %  [95 % CI {pct(low)} .. {pct(high)}; IQR {pct(q1)} .. {pct(q3)}]"


def pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=300, help="rounds with the tiny model")
    p.add_argument("--direct-rounds", type=int, default=150, help="rounds at the ~10 ms step")
    p.add_argument("--warmup-rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=20, help="steps per segment at the ~10 ms step")
    p.add_argument("--cost-steps", type=int, default=20, help="steps per segment, tiny model")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=80)
    p.add_argument("--url", default=None, help="a real collector (default: a local HTTP sink)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round mode orders")
    p.add_argument("--job-id", default=f"bench-overhead-{int(time.time())}")
    args = p.parse_args()
    url = args.url
    if url is None:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"

    tiny = Shape(width=16, depth=1, batch=4, steps=args.cost_steps, rounds=args.rounds)
    cost = Phase(run_ranks(url, args, tiny))
    print(
        f"1. Cost per step: a tiny model (width {tiny.width}, depth {tiny.depth}, batch "
        f"{tiny.batch}) makes the profiler's own time stand out. 2 gloo ranks, 1 torch thread "
        f"each; {tiny.rounds} rounds x {len(MODES)} modes x {tiny.steps} steps, random order."
    )
    print_table(
        cost,
        step_header="step us",
        step=lambda mode: f"{cost.median_ms(mode) * 1e3:.0f}",
        wall_header="wall us/step vs plain: median [95 % CI]",
        wall=lambda mode: cost_text(cost, mode),
    )

    shape = Shape(
        width=args.width,
        depth=args.depth,
        batch=args.batch,
        steps=args.steps,
        rounds=args.direct_rounds,
    )
    direct = Phase(run_ranks(url, args, shape))
    print(
        f"\n2. The ~10 ms step (width {shape.width}, depth {shape.depth}, batch {shape.batch}): "
        f"{shape.rounds} rounds x {len(MODES)} modes x {shape.steps} steps, random order."
    )
    print_table(
        direct,
        step_header="step ms",
        step=lambda mode: f"{direct.median_ms(mode):.2f}",
        wall_header="wall vs plain: median [95 % CI; IQR of ratios]",
        wall=lambda mode: ratio_text(direct, mode),
    )

    plain_ms = direct.median_ms("plain")
    cost_us, cost_low, cost_high = median_ci(cost.wall_us("profiled"))
    estimate_pct = cost_us / (plain_ms * 1e3) * 100
    ratio, low, high = median_ci(direct.ratios("profiled"))
    verdict = "met" if estimate_pct <= GOAL_OVERHEAD_PCT else "NOT met"
    print(f"\nplain step:    {plain_ms:.2f} ms (median over rounds)")
    print(
        f"overhead:      {estimate_pct:+.2f} % = cost {cost_us:+.1f} us "
        f"[95 % CI {cost_low:+.1f} .. {cost_high:+.1f}] / plain step; "
        f"goal <= {GOAL_OVERHEAD_PCT:.0f} % at a ~10 ms step: {verdict}"
    )
    print(
        f"               measured directly at that step: {pct(ratio)} % "
        f"[95 % CI {pct(low)} .. {pct(high)}] (wall-time noise of this shared 2-core machine)"
    )
    results = direct.results
    total_bytes = sum(r["bytes_sent"] for r in results)
    total_steps = sum(r["steps_sent"] for r in results)
    bytes_per_step = total_bytes / max(total_steps, 1)
    print(
        f"wire bytes:    {bytes_per_step:.0f} B per rank-step gzipped ({total_bytes} B for "
        f"{total_steps} rank-steps in {sum(r['batches_sent'] for r in results)} batches); "
        f"goal <= {GOAL_WIRE_BYTES} B: {'met' if bytes_per_step <= GOAL_WIRE_BYTES else 'NOT met'}"
    )
    print("rows sent:     " + json.dumps([r["rows_sent"] for r in results]))
    shipper_us = paced_shipper_us(url)
    print(
        f"shipper:       {shipper_us:.1f} us CPU per step in its own thread at a 10 ms step "
        f"(batches of 200 steps)"
    )
    hot_us = hot_path_us(url)
    print(
        f"hot path:      {hot_us:.1f} us CPU per step without a model (step, 3 sections, "
        f"record, loader; no DDP)"
    )


if __name__ == "__main__":
    main()
