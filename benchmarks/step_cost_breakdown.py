"""Where the profiler's cost per step goes, inside the training thread of a DDP step.

One process, a 1-rank gloo group, two identical DDP models (same seed, same batches): model A
trains plainly and model B under stepscope, their steps alternating one for one, so the
machine's slow swings (which move a segment's step time by several %) hit both alike. The
paired difference of the training thread's CPU time per step, B - A, is the profiler's cost
per step where it runs (its background threads are measured in profiler_overhead.py). Arms,
one process each, in the order given:

    a/a      B trains plainly too: the control (A and B differ only in where their tensors
             live; their difference is this harness's floor)
    full     stepscope.init(model=B) with its defaults: step, 3 sections, record, the
             wrapped loader, DDP's step timer
    no_ddp   the same without the DDP step timer (comm_timing="off")
    trivial  no stepscope: four context managers that read perf_counter and append to a
             list, where the profiler's step and sections are: the floor of any per-step
             instrumentation of this loop written in Python

Then, for `full`, the time spent inside each of the profiler's entry points per step
(wall time between entering and leaving it, with a thin wrapper around each), on the same
~8 ms step and on a tiny model: the same code, and how much longer it takes between heavy
compute.

    flock /tmp/stepscope-bench.lock .venv/bin/python benchmarks/step_cost_breakdown.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import stepscope

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profiler_cost import _Sink, build_model, free_port, median_ci  # noqa: E402

ARMS = ("a/a", "full", "no_ddp", "trivial")
ENTRY_POINTS = {
    "stepscope.profiler.loop.scopes.Step": ("__enter__", "__exit__"),
    "stepscope.profiler.loop.scopes.Section": ("__enter__", "__exit__"),
    "stepscope.profiler.active.ActiveProfiler": (
        "step",
        "section",
        "record",
    ),
    "stepscope.profiler.loop.finished.FinishedSteps": ("_ship",),
    "stepscope.profiler.collectives.ddp.DdpStepTimer": (
        "_gradients_computed",
        "_gradients_reduced",
    ),
}
"""The entry points timed in the breakdown (`_ship` runs on the shipper thread: the time it
takes there, per step)."""


class _Span:
    """What the `trivial` arm puts where a step or section is: a perf_counter read at each
    end, appended to a list."""

    __slots__ = ("_spans", "_start")

    def __init__(self, spans: list[float]) -> None:
        self._spans = spans
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *_: object) -> None:
        self._spans.append(time.perf_counter() - self._start)


def _instrument() -> dict[str, float]:
    """Wrap every entry point; seconds spent in each, summed over the run."""
    import importlib

    spent_s: dict[str, float] = {}
    clock = time.perf_counter

    def timed(original: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                spent_s[key] += clock() - start

        return wrapper

    for path, names in ENTRY_POINTS.items():
        module_name, class_name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), class_name)
        for name in names:
            key = f"{class_name}.{name}"
            spent_s[key] = 0.0
            setattr(cls, name, timed(getattr(cls, name), key))
    return spent_s


def run_arm(arm: str, width: int, batch: int, num_steps: int, instrument: bool) -> dict[str, Any]:
    """One arm in this process: training-thread CPU per step of A and B, and the breakdown."""
    spent_s = _instrument() if instrument else {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    model_a, model_b = (DistributedDataParallel(build_model(width, 3)) for _ in range(2))
    opt_a = torch.optim.SGD(model_a.parameters(), lr=1e-4)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(batch, width, generator=gen) for _ in range(64)]
    batches = [(x, x.sum(dim=1, keepdim=True)) for x in xs]
    url = f"http://127.0.0.1:{server.server_address[1]}"
    prof = None
    if arm in ("full", "no_ddp"):
        comm_timing = "step" if arm == "full" else "off"
        prof = stepscope.init(job_id="breakdown", url=url, model=model_b, comm_timing=comm_timing)
        assert prof.enabled

    def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    spans: list[float] = []

    def trivial_step(x: Any, y: Any) -> None:
        with _Span(spans):
            with _Span(spans):
                loss = nn.functional.mse_loss(model_b(x), y)
            with _Span(spans):
                loss.backward()
            with _Span(spans):
                opt_b.step()
                opt_b.zero_grad(set_to_none=True)
        if len(spans) > 1000:
            spans.clear()

    def profiled_step(x: Any, y: Any) -> None:
        assert prof is not None
        with prof.step():
            with prof.section("forward"):
                loss = nn.functional.mse_loss(model_b(x), y)
            with prof.section("backward"):
                loss.backward()
            with prof.section("optimizer"):
                opt_b.step()
                opt_b.zero_grad(set_to_none=True)
            prof.record(samples=x.shape[0])

    def forever() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        index = 0
        while True:
            yield batches[index % len(batches)]
            index += 1

    loader = iter(prof.wrap_dataloader(forever()) if prof is not None else forever())
    thread_time = time.thread_time
    warmup = num_steps // 10
    a_s: list[float] = []
    b_s: list[float] = []
    for index in range(num_steps + warmup):
        x, y = batches[index % len(batches)]
        start = thread_time()
        plain_step(model_a, opt_a, x, y)
        middle = thread_time()
        x, y = next(loader)
        if arm == "a/a":
            plain_step(model_b, opt_b, x, y)
        elif arm == "trivial":
            trivial_step(x, y)
        else:
            profiled_step(x, y)
        end = thread_time()
        if index == warmup:
            for key in spent_s:
                spent_s[key] = 0.0
        if index >= warmup:
            a_s.append(middle - start)
            b_s.append(end - middle)
    if prof is not None:
        prof.close()
    return {
        "plain_us": statistics.median(a_s) * 1e6,
        "diffs_us": [(b - a) * 1e6 for a, b in zip(a_s, b_s, strict=True)],
        "spent_us": {key: s / num_steps * 1e6 for key, s in spent_s.items()},
    }


def child(args: Any) -> None:
    import json

    result = run_arm(args.arm, args.width, args.batch, args.steps, args.instrument)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # gloo can abort at interpreter exit


def launch(arm: str, width: int, batch: int, steps: int, instrument: bool) -> dict[str, Any]:
    import json

    command = [sys.executable, __file__, "--child", "--arm", arm, "--width", str(width)]
    command += ["--batch", str(batch), "--steps", str(steps)]
    if instrument:
        command.append("--instrument")
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    [line] = [line for line in out.splitlines() if line.startswith("RESULT ")]
    return dict(json.loads(line.removeprefix("RESULT ")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=1500, help="steps of each model per arm")
    p.add_argument("--width", type=int, default=512, help="the ~8 ms step (batch 80)")
    p.add_argument("--batch", type=int, default=80)
    p.add_argument("--tiny-width", type=int, default=64)
    p.add_argument("--tiny-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="processes per arm")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", default="full", help=argparse.SUPPRESS)
    p.add_argument("--instrument", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    print(
        f"Training-thread CPU per step, profiled model B - plain model A, alternating every step "
        f"({args.steps} pairs per process, {args.repeats} processes per arm; median of the "
        "pairs with its bootstrap 95 % interval, per process):"
    )
    for arm in ARMS:
        figures = []
        for _ in range(args.repeats):
            result = launch(arm, args.width, args.batch, args.steps, instrument=False)
            median, low, high = median_ci(result["diffs_us"], num_resamples=500)
            figures.append(f"{median:+6.1f} [{low:+.1f} .. {high:+.1f}]")
        print(f"  {arm:8} {'; '.join(figures)} us (plain step {result['plain_us']:.0f} us)")
    print("Time inside each entry point per step, `full` (wall µs; wrappers included):")
    shapes = {"~8 ms": (args.width, args.batch), "tiny": (args.tiny_width, args.tiny_batch)}
    spent = {
        name: launch("full", width, batch, args.steps, instrument=True)
        for name, (width, batch) in shapes.items()
    }
    print(f"  {'entry point':38} " + " ".join(f"{name:>8}" for name in shapes))
    for key in spent["~8 ms"]["spent_us"]:
        values = " ".join(f"{spent[name]['spent_us'][key]:8.1f}" for name in shapes)
        print(f"  {key:38} {values}")
    steps = " ".join(f"{spent[name]['plain_us']:8.0f}" for name in shapes)
    print(f"  {'(plain step)':38} {steps}")


if __name__ == "__main__":
    main()
