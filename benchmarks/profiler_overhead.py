"""Step-time overhead of stepscope at a ~10 ms CPU step, DDP and FSDP2, two methods.

Separate processes. Every launch is a fresh pair of gloo rank processes (forked, one torch
thread each) that trains one model for a warm-up segment and a measured segment, in one of
three modes:

    plain      no stepscope
    plain_b    no stepscope either: the A/A control, its "overhead" is the noise
    profiled   stepscope.init(model=...) with its defaults, step/sections/record/wrapped
               loader, shipping to a local HTTP sink (or --url): its threads run in the
               rank's process, so the shipper's and the tap's costs count

for each of DDP and FSDP2 (fully_shard on every Linear, then the root). A round launches
the six (parallelism, mode) pairs in a random order; a launch's step time is the median
(and the mean) of its measured steps, averaged over the two ranks. The overhead is the
median over rounds of the paired ratio profiled/plain, with a bootstrap 95 % interval; the
A/A ratio beside it shows the wall-time noise of this shared 2-core machine. CPU per
step is the process's (all threads: shipper, gloo, ...) and the training thread's, over the
measured segment. The CPU overhead is the work stepscope adds whatever the scheduler makes
of it: per round, the process CPU per step (every thread) profiled less plain, in % of the
plain median step, median over rounds with a bootstrap 95 % interval (and its A/A). Wall
time on a shared machine swings with other load; CPU time per step much less, so it is the
tight figure. Wire bytes are the gzipped request bodies acknowledged, per rank-step.

Alternating segments. Per parallelism, one pair of rank processes trains segments of
every mode (a fresh profiler, started and closed outside the measured steps, for each
profiled one) in a random order, round after round, so that each round's segments share the
machine's load of the moment; the same figures come from the paired rounds. The same is run
on a tiny model of the same depth (the same collectives per step; DDP's step is ~1 ms,
FSDP2's stays near its ~10 ms, bound by gloo's latency): its paired difference in mean step
time, profiled less plain, is the profiler's cost per step in µs (every periodic cost in it,
its threads' included), and that cost over the ~10 ms plain step is a second estimate of the
overhead.

A verdict says "not resolved here" when its A/A interval is wider than +-the goal: on a
shared machine under load, no figure can then show the goal met or missed.

The per-step cost on a tiny model, both comm_timing levels and the bare comm-hook floor
(in one process) are in profiler_cost.py; the tap's cost per collective in collective_tap.py.

    flock /tmp/stepscope-bench.lock .venv/bin/python benchmarks/profiler_overhead.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import stepscope

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profiler_cost import (  # noqa: E402
    GOAL_OVERHEAD_PCT,
    GOAL_WIRE_BYTES,
    _Sink,
    build_model,
    free_port,
    median_ci,
    pct,
    plain_segment,
    profiled_segment,
)

MODES = ("plain", "plain_b", "profiled")
WORLD_SIZE = 2
TINY_WIDTH, TINY_BATCH = 32, 8
"""The tiny model of the alternating method: the same depth (collectives), a ~1 ms step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """One pair of rank processes: what they train, how, and for how long."""

    parallel: str
    """"ddp" or "fsdp2"."""
    mode: str
    width: int
    depth: int
    batch: int
    warmup_steps: int
    steps: int
    """Measured steps (alternating: per segment)."""
    rounds: int = 0
    """Alternating: rounds of one segment per mode, in one pair of processes (0: separate)."""
    seed: int = 0


def wrap(model: nn.Module, parallel: str) -> nn.Module:
    """DDP, or FSDP2 with every Linear a unit of its own under the root."""
    if parallel == "ddp":
        return DistributedDataParallel(model)
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def rank_main(rank: int, launch: Launch, port: int, url: str, job_id: str, queue: Any) -> None:
    """Train `launch` on this rank: one mode (separate), or rounds of segments of every mode
    (alternating); step times, CPU times and shipper stats on `queue`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    model = wrap(build_model(launch.width, launch.depth), launch.parallel)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    xs = [
        torch.randn(launch.batch, launch.width, generator=gen)
        for _ in range(launch.warmup_steps + launch.steps)
    ]
    batches = [(x, x.sum(dim=1, keepdim=True)) for x in xs]
    if launch.rounds:
        rng = random.Random(launch.seed)  # the same order on both ranks
        rounds = [
            {
                mode: segment(model, opt, batches, launch, mode, url, f"{job_id}-{index}", rank)
                for mode in rng.sample(MODES, len(MODES))
            }
            for index in range(launch.rounds)
        ]
        queue.put({"rank": rank, "rounds": rounds})
    else:
        queue.put(segment(model, opt, batches, launch, launch.mode, url, job_id, rank))
    dist.barrier()
    dist.destroy_process_group()


def segment(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    launch: Launch,
    mode: str,
    url: str,
    job_id: str,
    rank: int,
) -> dict[str, Any]:
    """Warm-up and measured steps in `mode` (profiled: a profiler of its own, closed after)."""
    prof = None
    if mode == "profiled":
        prof = stepscope.init(job_id=job_id, url=url, model=model)
        assert prof.enabled
    warmup, measured = batches[: launch.warmup_steps], batches[launch.warmup_steps :]
    dist.barrier()
    if prof is None:
        plain_segment(model, opt, warmup)
    else:
        profiled_segment(model, opt, warmup, prof)
    thread_start_s, process_start_s = time.thread_time(), time.process_time()
    if prof is None:
        times_s = plain_segment(model, opt, measured)
    else:
        times_s = profiled_segment(model, opt, measured, prof)
    result: dict[str, Any] = {
        "rank": rank,
        "median_s": statistics.median(times_s),
        "mean_s": statistics.mean(times_s),
        "thread_cpu_s": (time.thread_time() - thread_start_s) / len(times_s),
        "process_cpu_s": (time.process_time() - process_start_s) / len(times_s),
    }
    result["background_cpu_s"] = result["process_cpu_s"] - result["thread_cpu_s"]
    if prof is not None:
        prof.close()
        stats = prof.shipper.stats  # type: ignore[attr-defined]
        result.update(
            bytes_sent=stats.num_bytes_sent,
            rows_sent=dict(stats.num_rows_sent),
            batches_sent=stats.num_batches_sent,
            shipper_cpu_s=stats.thread_cpu_s,
        )
    return result


def run_launch(launch: Launch, url: str, job_id: str) -> list[dict[str, Any]]:
    """Both ranks of one launch, in fresh processes; their results by rank."""
    ctx = mp.get_context("fork")  # the parent has imported torch but run no torch op
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(rank, launch, port, url, job_id, queue))
        for rank in range(WORLD_SIZE)
    ]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(60)
    return results


class Phase:
    """Per-round results of one parallelism, by mode."""

    def __init__(self, rounds: list[dict[str, list[dict[str, Any]]]]) -> None:
        self.rounds = rounds

    def per_round(self, mode: str, key: str) -> list[float]:
        """A rank-mean `key` per round (the ranks wait for each other: one measurement)."""
        return [statistics.mean(r[key] for r in ranks[mode]) for ranks in self.rounds]

    def ratios(self, mode: str, key: str) -> list[float]:
        base = self.per_round("plain", key)
        return [t / b for t, b in zip(self.per_round(mode, key), base, strict=True)]

    def ratio_text(self, mode: str, key: str) -> str:
        median, low, high = median_ci(self.ratios(mode, key))
        return f"{pct(median)} % [{pct(low)} .. {pct(high)}]"

    def cpu_text(self, mode: str) -> str:
        process_ms = statistics.median(self.per_round(mode, "process_cpu_s")) * 1e3
        thread_ms = statistics.median(self.per_round(mode, "thread_cpu_s")) * 1e3
        return f"{process_ms:6.2f}, {thread_ms:6.2f}"

    def cpu_delta_text(self, mode: str) -> str:
        process_us, thread_us = (
            statistics.median(self.deltas_us(mode, key))
            for key in ("process_cpu_s", "thread_cpu_s")
        )
        return f"{process_us:+6.0f}, {thread_us:+6.0f}"

    def deltas_us(self, mode: str, key: str) -> list[float]:
        """Per round, `key` (seconds per step) under `mode` less plain's, in µs."""
        pairs = zip(self.per_round(mode, key), self.per_round("plain", key), strict=True)
        return [(t - b) * 1e6 for t, b in pairs]

    def cpu_share_pct(self, mode: str, key: str) -> list[float]:
        """Per round, the CPU per step `mode` adds to plain's (`key`), in % of plain's median
        step: the cost in work, whatever the scheduler made of it in wall time."""
        steps_s = self.per_round("plain", "median_s")
        deltas_us = self.deltas_us(mode, key)
        return [d * 1e-6 / step_s * 100 for d, step_s in zip(deltas_us, steps_s, strict=True)]

    def profiled_results(self) -> list[dict[str, Any]]:
        return [r for ranks in self.rounds for r in ranks["profiled"]]


def print_phase(title: str, phase: Phase) -> None:
    print(f"\n{title}")
    print(
        f"{'mode':9} {'step ms':>7}  {'vs plain: median step [95 % CI]':>33}  "
        f"{'mean step [95 % CI]':>25}  {'CPU ms/step: process, thread':>28}  "
        f"{'vs plain, us':>14}"
    )
    for mode in MODES:
        step_ms = statistics.median(phase.per_round(mode, "median_s")) * 1e3
        cells = ("", "", "")
        if mode != "plain":
            cells = (
                phase.ratio_text(mode, "median_s"),
                phase.ratio_text(mode, "mean_s"),
                phase.cpu_delta_text(mode),
            )
        print(
            f"{mode:9} {step_ms:7.2f}  {cells[0]:>33}  {cells[1]:>25}  "
            f"{phase.cpu_text(mode):>28}  {cells[2]:>14}"
        )


def verdict(median_pct: float, high_pct: float, aa_low_pct: float, aa_high_pct: float) -> str:
    """The goal's verdict on an overhead in %, honest about an A/A control wider than it."""
    if aa_high_pct - aa_low_pct > 2 * GOAL_OVERHEAD_PCT:
        return "not resolved here (the A/A interval is wider than +-the goal)"
    if high_pct <= GOAL_OVERHEAD_PCT:
        return "met"
    if median_pct <= GOAL_OVERHEAD_PCT:
        return "met by the median, not by the CI's upper end"
    return "NOT met"


def print_summary(name: str, phase: Phase) -> None:
    ratio, low, high = (
        (value - 1) * 100 for value in median_ci(phase.ratios("profiled", "median_s"))
    )
    aa, aa_low, aa_high = (
        (value - 1) * 100 for value in median_ci(phase.ratios("plain_b", "median_s"))
    )
    print(
        f"{name + ' overhead:':16} {ratio:+.2f} % [95 % CI {low:+.2f} .. {high:+.2f}]; "
        f"A/A {aa:+.2f} % [{aa_low:+.2f} .. {aa_high:+.2f}]; "
        f"goal <= {GOAL_OVERHEAD_PCT:.0f} %: {verdict(ratio, high, aa_low, aa_high)}"
    )
    cpu, cpu_low, cpu_high = median_ci(phase.cpu_share_pct("profiled", "process_cpu_s"))
    aa, aa_low, aa_high = median_ci(phase.cpu_share_pct("plain_b", "process_cpu_s"))
    print(
        f"{name + ' CPU:':16} {cpu:+.2f} % [95 % CI {cpu_low:+.2f} .. {cpu_high:+.2f}] of the "
        f"plain step; A/A {aa:+.2f} % [{aa_low:+.2f} .. {aa_high:+.2f}]; "
        f"goal <= {GOAL_OVERHEAD_PCT:.0f} %: {verdict(cpu, cpu_high, aa_low, aa_high)}"
    )
    background = phase.deltas_us("profiled", "background_cpu_s")
    aa_background = phase.deltas_us("plain_b", "background_cpu_s")
    print(
        f"{name + ' threads:':16} {statistics.median(background):+.0f} us CPU per step in "
        f"threads other than the training thread (A/A {statistics.median(aa_background):+.0f} us)"
    )


def print_shipping(name: str, phase: Phase, steps_per_launch: int) -> None:
    results = phase.profiled_results()
    total_bytes = sum(r["bytes_sent"] for r in results)
    total_steps = sum(r["rows_sent"].get("steps", 0) for r in results)
    bytes_per_step = total_bytes / max(total_steps, 1)
    verdict = "met" if bytes_per_step <= GOAL_WIRE_BYTES else "NOT met"
    shipper_us = statistics.median(r["shipper_cpu_s"] for r in results) / steps_per_launch * 1e6
    print(
        f"{name + ' wire:':16} {bytes_per_step:.0f} B per rank-step gzipped ({total_bytes} B, "
        f"{total_steps} rank-steps, {sum(r['batches_sent'] for r in results)} batches); "
        f"goal <= {GOAL_WIRE_BYTES} B: {verdict}"
    )
    print(
        f"{name + ' shipper:':16} {shipper_us:.1f} us CPU per step in its own thread "
        f"(median launch, final flush included)"
    )
    print(f"{name + ' rows:':16} " + json.dumps(results[0]["rows_sent"]) + " (one launch, rank 0)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--rounds", type=int, default=None, help="separate method: 16, or 3 with --quick (0: off)"
    )
    p.add_argument("--warmup-rounds", type=int, default=1, help="rounds run and discarded")
    p.add_argument("--steps", type=int, default=300, help="measured steps per launch")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--width", type=int, default=512, help="DDP model")
    p.add_argument("--depth", type=int, default=3, help="DDP model")
    p.add_argument("--batch", type=int, default=80, help="DDP model")
    p.add_argument("--fsdp-width", type=int, default=256)
    p.add_argument("--fsdp-depth", type=int, default=1)
    p.add_argument("--fsdp-batch", type=int, default=32)
    p.add_argument(
        "--segment-rounds",
        type=int,
        default=None,
        help="alternating method: rounds of one segment per mode (40, or 6 with --quick; 0: off)",
    )
    p.add_argument("--segment-steps", type=int, default=100, help="measured steps per segment")
    p.add_argument("--quick", action="store_true", help="3 rounds of 60 steps, no warm-up round")
    p.add_argument("--url", default=None, help="a real collector (default: a local HTTP sink)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round launch orders")
    p.add_argument("--job-id", default=f"bench-overhead-{int(time.time())}")
    args = p.parse_args()
    if args.quick:
        args.warmup_rounds, args.steps, args.warmup_steps = 0, 60, 10
    args.rounds = args.rounds if args.rounds is not None else (3 if args.quick else 16)
    if args.segment_rounds is None:
        args.segment_rounds = 6 if args.quick else 40
    url = args.url
    if url is None:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
    shapes = {
        "ddp": (args.width, args.depth, args.batch),
        "fsdp2": (args.fsdp_width, args.fsdp_depth, args.fsdp_batch),
    }
    if args.rounds:
        separate(args, shapes, url)
    if args.segment_rounds:
        alternating(args, shapes, url)


def separate(args: Any, shapes: dict[str, tuple[int, int, int]], url: str) -> None:
    """Every (parallelism, mode) in fresh processes, rounds of them in a random order."""
    launches = [
        Launch(
            parallel=parallel,
            mode=mode,
            width=width,
            depth=depth,
            batch=batch,
            warmup_steps=args.warmup_steps,
            steps=args.steps,
        )
        for parallel, (width, depth, batch) in shapes.items()
        for mode in MODES
    ]
    rng = random.Random(args.seed)
    rounds: dict[str, list[dict[str, list[dict[str, Any]]]]] = {name: [] for name in shapes}
    for round_index in range(args.warmup_rounds + args.rounds):
        results = {}
        for launch in rng.sample(launches, len(launches)):
            job_id = f"{args.job_id}-{launch.parallel}-{round_index}"
            results[(launch.parallel, launch.mode)] = run_launch(launch, url, job_id)
        print(f"round {round_index + 1}/{args.warmup_rounds + args.rounds}", file=sys.stderr)
        if round_index >= args.warmup_rounds:
            for name in shapes:
                rounds[name].append({mode: results[(name, mode)] for mode in MODES})
    print(
        f"Separate processes: {args.rounds} rounds x {len(launches)} launches (2 gloo ranks, "
        f"1 torch thread each) in a random order; {args.warmup_steps} warm-up + {args.steps} "
        f"measured steps per launch"
    )
    phases = {name: Phase(rounds[name]) for name in shapes}
    for name, (width, depth, batch) in shapes.items():
        print_phase(f"{name.upper()} (width {width}, depth {depth}, batch {batch}):", phases[name])
    print()
    for name in shapes:
        print_summary(name.upper(), phases[name])
    for name in shapes:
        print_shipping(name.upper(), phases[name], args.warmup_steps + args.steps)


def alternating(args: Any, shapes: dict[str, tuple[int, int, int]], url: str) -> None:
    """Per parallelism, one pair of processes that alternates segments of every mode in a
    random order, round after round (adjacent segments share the machine's load of the
    moment): on the ~10 ms step, and on a tiny model of the same depth (the same collectives
    per step, a ~1 ms step), whose paired difference is the profiler's cost per step."""
    warmup_steps = 10
    print(
        f"\nAlternating segments: per parallelism and model one pair of processes, "
        f"{args.segment_rounds} rounds of one segment per mode in a random order; "
        f"{warmup_steps} warm-up + {args.segment_steps} measured steps per segment, a fresh "
        f"profiler per profiled segment"
    )
    phases: dict[str, tuple[Phase, Phase]] = {}
    for name, (width, depth, batch) in shapes.items():
        pair = []
        for width_, batch_ in ((width, batch), (TINY_WIDTH, TINY_BATCH)):
            launch = Launch(
                parallel=name,
                mode="alternating",
                width=width_,
                depth=depth,
                batch=batch_,
                warmup_steps=warmup_steps,
                steps=args.segment_steps,
                rounds=args.segment_rounds,
                seed=args.seed,
            )
            by_rank = run_launch(launch, url, f"{args.job_id}-{name}-{width_}-alternating")
            rounds = [
                {mode: [r["rounds"][index][mode] for r in by_rank] for mode in MODES}
                for index in range(args.segment_rounds)
            ]
            pair.append(Phase(rounds))
            print_phase(
                f"{name.upper()} (width {width_}, depth {depth}, batch {batch_}):", pair[-1]
            )
        phases[name] = (pair[0], pair[1])
    print()
    for name, (full, tiny) in phases.items():
        print_summary(name.upper(), full)
        print_cost(name.upper(), tiny, statistics.median(full.per_round("plain", "median_s")))


def print_cost(name: str, tiny: Phase, step_s: float) -> None:
    """The profiler's cost per step on the tiny model (mean step, every periodic cost in it),
    and its share of the ~10 ms step."""
    cost_us, low_us, high_us = median_ci(tiny.deltas_us("profiled", "mean_s"))
    aa_us, aa_low_us, aa_high_us = median_ci(tiny.deltas_us("plain_b", "mean_s"))
    share, share_low, share_high = (v * 1e-6 / step_s * 100 for v in (cost_us, low_us, high_us))
    aa_low, aa_high = (v * 1e-6 / step_s * 100 for v in (aa_low_us, aa_high_us))
    print(
        f"{name + ' cost:':16} {cost_us:+.1f} us per step [95 % CI {low_us:+.1f} .. "
        f"{high_us:+.1f}] on the tiny model (A/A {aa_us:+.1f} [{aa_low_us:+.1f} .. "
        f"{aa_high_us:+.1f}]) = {share:+.2f} % [{share_low:+.2f} .. {share_high:+.2f}] of the "
        f"{step_s * 1e3:.2f} ms plain step; goal <= {GOAL_OVERHEAD_PCT:.0f} %: "
        f"{verdict(share, share_high, aa_low, aa_high)}"
    )


if __name__ == "__main__":
    main()
