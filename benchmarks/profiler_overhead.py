"""Step-time overhead and wire bytes of the in-process profiler on a ~10 ms CPU DDP step.

Two gloo ranks (torch.multiprocessing, one torch thread each) hold identical DDP models
(same seed) and train them in short interleaved segments on the same batches:

    plain           DDP as is
    plain_b         a second plain model: the A/A control, its "overhead" is the noise
    builtin_hook    DDP + its built-in C++ all-reduce hook (any hook unfuses DDP's
                    gradient scaling from its copy into the bucket: one more pass)
    bare_hook       DDP + the cheapest Python comm hook that keeps DDP's arithmetic
                    (scale, all-reduce, one future callback): the floor of a timing hook
    stepscope_hook  DDP + stepscope's timing hook alone (no step/sections/shipping)
    profiled        DDP watched by stepscope, with step/sections/record/wrapped loader

Each round runs one segment of every mode on the same batches, in a random order (the
same on both ranks) so that no mode always follows another. A round's step time of a
mode is the median of its segment's steps, averaged over the two ranks (they wait for
each other at every all-reduce, so they are one measurement). Overhead is the median
over rounds of the paired ratio mode/plain; the IQR of those ratios shows the noise, and
a bootstrap 95 % interval shows how well the median is known. The training thread's CPU
time per step (median paired difference to plain) is far less noisy than wall time and
says where the cost is. Wire bytes are the gzipped
request bodies the collector acknowledged, per rank-step (a local HTTP sink, or a real
collector with --url).

    flock /tmp/stepscope-bench.lock .venv/bin/python benchmarks/profiler_overhead.py
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
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import stepscope
from stepscope.profiler.comm import CollectiveCall, make_ddp_hook
from stepscope.profiler.timer import CpuClock

MODES = ("plain", "plain_b", "builtin_hook", "bare_hook", "stepscope_hook", "profiled")
ABOUT = {
    "plain": "DDP, no hook",
    "plain_b": "A/A control: a second plain model",
    "builtin_hook": "DDP's built-in C++ all-reduce hook",
    "bare_hook": "minimal Python hook (floor of any timing hook)",
    "stepscope_hook": "stepscope's DDP timing hook alone",
    "profiled": "full profiler",
}
GOAL_OVERHEAD_PCT = 1.0
GOAL_WIRE_BYTES = 3072


class _Sink(BaseHTTPRequestHandler):
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
    ddp: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]
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
    batches: list[tuple[torch.Tensor, torch.Tensor]],
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


def worker(rank: int, world_size: int, port: int, url: str, args: Any, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    models = {mode: DistributedDataParallel(build_model(args.width, args.depth)) for mode in MODES}
    models["builtin_hook"]._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    models["bare_hook"].register_comm_hook(None, bare_hook)
    calls: list[CollectiveCall] = []
    models["stepscope_hook"].register_comm_hook(
        models["stepscope_hook"].process_group,
        make_ddp_hook(clock=CpuClock(), record=calls.append),
    )
    opts = {mode: torch.optim.SGD(m.parameters(), lr=1e-4) for mode, m in models.items()}
    prof = stepscope.init(job_id=args.job_id, url=url, model=models["profiled"])
    assert prof.enabled
    gen = torch.Generator().manual_seed(rank)
    order_rng = random.Random(args.seed)  # the same orders on every rank
    times_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    dist.barrier()
    for round_index in range(args.warmup_rounds + args.rounds):
        xs = [torch.randn(args.batch, args.width, generator=gen) for _ in range(args.steps)]
        batches = [(x, x.sum(dim=1, keepdim=True)) for x in xs]
        for mode in order_rng.sample(MODES, len(MODES)):
            cpu_start_s = time.thread_time()
            if mode == "profiled":
                steps_s = profiled_segment(models[mode], opts[mode], batches, prof)
            else:
                steps_s = plain_segment(models[mode], opts[mode], batches)
                calls.clear()
            if round_index >= args.warmup_rounds:
                times_s[mode].append(statistics.median(steps_s))
                cpu_s[mode].append((time.thread_time() - cpu_start_s) / len(steps_s))
    prof.close()
    stats = prof.shipper.stats  # type: ignore[attr-defined]
    queue.put(
        {
            "rank": rank,
            "times_s": times_s,
            "cpu_s": cpu_s,
            "bytes_sent": stats.num_bytes_sent,
            "steps_sent": stats.num_rows_sent["steps"],
            "rows_sent": dict(stats.num_rows_sent),
            "batches_sent": stats.num_batches_sent,
            "shipper_cpu_s": stats.thread_cpu_s,
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


def ratio_summary(ratios: list[float], *, num_resamples: int = 2000) -> str:
    """Median of paired ratios with its bootstrap 95 % interval and the ratios' IQR, in %."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(num_resamples)
    )
    low, high = medians[int(0.025 * num_resamples)], medians[int(0.975 * num_resamples) - 1]
    q1, median, q3 = statistics.quantiles(ratios, n=4)

    def pct(ratio: float) -> str:
        return f"{(ratio - 1) * 100:+.2f}"

    return (
        f"{pct(median)} %  [95 % CI {pct(low)} .. {pct(high)}; "
        f"IQR of ratios {pct(q1)} .. {pct(q3)}]"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=1500)
    p.add_argument("--warmup-rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=1, help="steps per segment (1: finest pairing)")
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--url", default=None, help="a real collector (default: a local HTTP sink)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round mode orders")
    p.add_argument("--job-id", default=f"bench-overhead-{int(time.time())}")
    args = p.parse_args()
    url = args.url
    if url is None:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
    world_size = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=worker, args=(rank, world_size, port, url, args, queue))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(60)

    # The ranks are synchronised by every all-reduce: average them into one time per round.
    per_round_s = {
        mode: [
            statistics.mean(ts) for ts in zip(*(r["times_s"][mode] for r in results), strict=True)
        ]
        for mode in MODES
    }

    def median_ms(mode: str) -> float:
        return statistics.median(per_round_s[mode]) * 1e3

    def ratios(mode: str) -> list[float]:
        return [t / base for t, base in zip(per_round_s[mode], per_round_s["plain"], strict=True)]

    def cpu_us(mode: str) -> float:
        """Median paired difference of training-thread CPU per step to plain, both ranks."""
        return statistics.median(
            (t - base) * 1e6
            for r in results
            for t, base in zip(r["cpu_s"][mode], r["cpu_s"]["plain"], strict=True)
        )

    plain_ms = median_ms("plain")
    overhead = ratios("profiled")
    overhead_pct = (statistics.median(overhead) - 1.0) * 100.0
    print(
        f"ranks: {world_size} (gloo, CPU, 1 thread each); {args.rounds} rounds x "
        f"{len(MODES)} modes x {args.steps} steps, random order per round; "
        f"{len(overhead)} paired ratios"
    )
    print(
        f"{'mode':15} {'step ms':>7}  {'wall vs plain: median [95 % CI; IQR of ratios]':52} "
        f"{'CPU us/step vs plain':>20}"
    )
    for mode in MODES:
        wall = "" if mode == "plain" else ratio_summary(ratios(mode))
        cpu = "" if mode == "plain" else f"{cpu_us(mode):+.0f}"
        print(f"{mode:15} {median_ms(mode):7.2f}  {wall:52} {cpu:>20}   {ABOUT[mode]}")
    verdict = "met" if overhead_pct <= GOAL_OVERHEAD_PCT else "NOT met"
    print(f"plain step:    {plain_ms:.2f} ms (median over rounds)")
    print(f"profiled step: {median_ms('profiled'):.2f} ms (median over rounds)")
    print(
        f"overhead:      {overhead_pct:+.2f} % (median paired ratio profiled/plain); "
        f"goal <= {GOAL_OVERHEAD_PCT:.0f} % at a ~10 ms step: {verdict}"
    )
    total_bytes = sum(r["bytes_sent"] for r in results)
    total_steps = sum(r["steps_sent"] for r in results)
    bytes_per_step = total_bytes / max(total_steps, 1)
    print(
        f"wire bytes:    {bytes_per_step:.0f} B per rank-step gzipped ({total_bytes} B for "
        f"{total_steps} rank-steps in {sum(r['batches_sent'] for r in results)} batches); "
        f"goal <= {GOAL_WIRE_BYTES} B: {'met' if bytes_per_step <= GOAL_WIRE_BYTES else 'NOT met'}"
    )
    print("rows sent:     " + json.dumps([r["rows_sent"] for r in results]))
    shipper_us = [r["shipper_cpu_s"] / max(r["steps_sent"], 1) * 1e6 for r in results]
    print(
        f"shipper:       {statistics.mean(shipper_us):.1f} us CPU per profiled step in its "
        f"thread ({statistics.mean(shipper_us) / (plain_ms * 10):.2f} % of a plain step; "
        f"spread over all modes' segments, so only part of it is in the overhead above)"
    )
    cost_us = hot_path_us(url)
    print(
        f"hot path:      {cost_us:.1f} us CPU per step without a model "
        f"({cost_us / (plain_ms * 10):.2f} % of the plain step; excludes the DDP hook)"
    )


if __name__ == "__main__":
    main()
