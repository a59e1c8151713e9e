"""Step-time overhead and wire bytes of the in-process profiler on a ~10 ms CPU DDP step.

Two gloo ranks (torch.multiprocessing) train two identical DDP models in alternating
blocks: one plain, one profiled (step/sections/dataloader/DDP hook). Overhead is the
median profiled block over the median plain block. Wire bytes are the gzipped request
bodies the shipper had acknowledged, per rank-step, sent to a local HTTP sink (or to a
real collector with --url).

    .venv/bin/python benchmarks/profiler_overhead.py [--blocks 10 --block-steps 25]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import stepscope


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


def loader(num: int, batch: int, width: int) -> Any:
    for _ in range(num):
        x = torch.randn(batch, width)
        yield x, x.sum(dim=1, keepdim=True)


def run_block(
    ddp: nn.Module, opt: torch.optim.Optimizer, prof: stepscope.Profiler | None, args: Any
) -> float:
    """Mean step time of one block, seconds."""
    data = loader(args.block_steps, args.batch, args.width)
    if prof is not None:
        data = prof.wrap_dataloader(data)
    dist.barrier()
    start = time.perf_counter()
    if prof is None:
        for x, y in data:
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        for x, y in data:
            with prof.step():
                with prof.section("forward"):
                    loss = nn.functional.mse_loss(ddp(x), y)
                with prof.section("backward"):
                    loss.backward()
                with prof.section("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                prof.record(samples=args.batch)
    return (time.perf_counter() - start) / args.block_steps


def worker(rank: int, world_size: int, port: int, url: str, args: Any, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    plain = DistributedDataParallel(build_model(args.width, args.depth))
    profiled = DistributedDataParallel(build_model(args.width, args.depth))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4)
    prof_opt = torch.optim.SGD(profiled.parameters(), lr=1e-4)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    prof = stepscope.init(job_id=args.job_id, url=url, model=profiled, flush_interval_s=2.0)
    assert prof.enabled
    for _ in range(2):  # warm-up of both models
        run_block(plain, plain_opt, None, args)
        run_block(profiled, prof_opt, prof, args)
    plain_s: list[float] = []
    profiled_s: list[float] = []
    for block in range(args.blocks):
        # Alternate which mode goes first so drift favours neither.
        order = [(plain_s, None), (profiled_s, prof)]
        for times, p in order if block % 2 == 0 else order[::-1]:
            model, opt = (plain, plain_opt) if p is None else (profiled, prof_opt)
            times.append(run_block(model, opt, p, args))
    prof.close()
    stats = prof.shipper.stats  # type: ignore[attr-defined]
    queue.put(
        {
            "rank": rank,
            "plain_s": plain_s,
            "profiled_s": profiled_s,
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
    prof = stepscope.init(job_id="bench-hot-path", url=url, flush_interval_s=2.0)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--block-steps", type=int, default=25)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--url", default=None, help="a real collector (default: a local HTTP sink)")
    p.add_argument("--job-id", default=f"bench-overhead-{int(time.time())}")
    args = p.parse_args()
    url = args.url
    server = None
    if url is None:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
    world_size = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, world_size, free_port_once, url, args, queue))
        for free_port_once in [free_port()]
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(60)

    plain = [statistics.median(r["plain_s"]) for r in results]
    profiled = [statistics.median(r["profiled_s"]) for r in results]
    # Per-block paired ratios (same block index, adjacent in time) are robust to drift.
    ratios = [
        pr / pl for r in results for pl, pr in zip(r["plain_s"], r["profiled_s"], strict=True)
    ]
    overhead_pct = (statistics.median(ratios) - 1.0) * 100.0
    total_bytes = sum(r["bytes_sent"] for r in results)
    total_steps = sum(r["steps_sent"] for r in results)
    print(f"ranks: {world_size} (gloo, CPU), blocks: {args.blocks} x {args.block_steps} steps/mode")
    print(f"plain step:    {statistics.mean(plain) * 1e3:.2f} ms (median of block means)")
    print(f"profiled step: {statistics.mean(profiled) * 1e3:.2f} ms (median of block means)")
    print(f"overhead:      {overhead_pct:+.2f} % (median of paired block ratios; goal <= 1 %)")
    print(
        f"wire bytes:    {total_bytes / max(total_steps, 1):.0f} B per rank-step gzipped "
        f"({total_bytes} B for {total_steps} rank-steps, "
        f"{sum(r['batches_sent'] for r in results)} batches; goal <= 3072 B)"
    )
    print("rows sent:     " + json.dumps([r["rows_sent"] for r in results]))
    cost_us = hot_path_us(url)
    print(
        f"hot path:      {cost_us:.1f} us CPU per step without a model "
        f"({cost_us / 100:.2f} % of a 10 ms step; excludes the DDP hook)"
    )


if __name__ == "__main__":
    main()
