"""A small CPU DDP (gloo) training run profiled by stepscope, with optional injected delays.

    torchrun --standalone --nproc_per_node=4 examples/ddp_train.py --url http://127.0.0.1:8000

Delays make one rank a straggler so the dashboard and the analysis have something to
find: `--delay-rank 2 --delay-phase backward --delay-s 0.05`. Without --url (or
STEPSCOPE_URL) the profiler is a no-op and the script just trains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset

import stepscope

PHASES = ("data", "forward", "backward", "optimizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--url", default=None, help="collector URL (else STEPSCOPE_URL)")
    p.add_argument("--job-id", default=None, help="job id (else STEPSCOPE_JOB_ID / torchrun's)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    p.add_argument("--delay-rank", type=int, default=-1, help="rank that gets the delay")
    p.add_argument("--delay-phase", choices=PHASES, default="backward")
    p.add_argument("--delay-s", type=float, default=0.0, help="delay per step, seconds")
    p.add_argument("--delay-from-step", type=int, default=0, help="first delayed step")
    p.add_argument(
        "--step-sleep-s", type=float, default=0.0, help="extra sleep per step, all ranks"
    )
    p.add_argument(
        "--mode",
        choices=("ddp", "async", "compiled", "allreduce"),
        default="ddp",
        help="ddp: train an MLP with DDP; async: without DDP, all-reducing each gradient with\n"
        "async_op=True then wait(); compiled: without DDP, all-reducing the flattened\n"
        "gradients in a torch.compile(fullgraph=True) function; allreduce: a loop of explicit\n"
        "dist.all_reduce calls",
    )
    p.add_argument("--compile-backend", default="aot_eager", help="torch.compile backend")
    p.add_argument("--allreduce-numel", type=int, default=1 << 18, help="floats per all_reduce")
    p.add_argument("--allreduce-per-step", type=int, default=4)
    p.add_argument("--flush-interval-s", type=float, default=0.5)
    p.add_argument("--spill-dir", default=None)
    p.add_argument("--break-profiler", action="store_true", help="make a profiler internal raise")
    p.add_argument("--no-stepscope", action="store_true", help="train without stepscope at all")
    p.add_argument("--out", default=None, help="directory for a per-rank JSON summary")
    return p.parse_args(argv)


class SyntheticBatches(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random regression batches; sleeps before each batch on the rank told to (iterated
    through a DataLoader, as a real job's input is)."""

    def __init__(self, *, steps: int, batch_size: int, width: int, delay_s: float) -> None:
        self.steps = steps
        self.batch_size = batch_size
        self.width = width
        self.delay_s = delay_s
        self.delay_from_step = 0

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(dist.get_rank())
        for i in range(self.steps):
            if self.delay_s and i >= self.delay_from_step:
                time.sleep(self.delay_s)
            x = torch.randn(self.batch_size, self.width, generator=gen)
            yield x, x.sum(dim=1, keepdim=True)


class MLP(nn.Module):
    def __init__(self, width: int, backward_delay_s: float) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        self.second = nn.Sequential(nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.head = nn.Linear(width, 1)
        self.forward_delay_s = 0.0
        self.backward_delay_s = backward_delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_delay_s:
            time.sleep(self.forward_delay_s)
        h = self.first(x)
        if self.backward_delay_s and h.requires_grad:
            delay_s = self.backward_delay_s

            def sleep_then_pass(grad: torch.Tensor) -> torch.Tensor:
                # Sleeps in the middle of backward: the gradients of `first` come late.
                time.sleep(delay_s)
                return grad

            h.register_hook(sleep_then_pass)
        return self.head(self.second(h))


def break_profiler() -> None:
    """Make an internal of the profiler raise, to show it never reaches the training loop."""
    from stepscope.profiler.loop import steps

    def broken(self: object, clock: object) -> object:
        raise RuntimeError("injected profiler bug")

    steps.StepRecord.to_rows = broken  # type: ignore[method-assign,assignment]


def train_ddp(args: argparse.Namespace, prof: stepscope.Profiler, rank: int) -> dict[str, Any]:
    """Data-parallel training of the MLP: DDP, or (--mode async/compiled) gradients all-reduced
    by hand after backward."""
    delayed = rank == args.delay_rank and args.delay_s > 0
    delay = {
        phase: args.delay_s if delayed and args.delay_phase == phase else 0.0 for phase in PHASES
    }
    torch.manual_seed(0)
    model = MLP(args.width, backward_delay_s=0.0)
    net: nn.Module = model
    sync_gradients: Callable[[list[torch.Tensor]], None] | None = None
    if args.mode == "ddp":
        net = DistributedDataParallel(model)
    elif args.mode == "async":
        sync_gradients = all_reduce_async
    else:
        sync_gradients = compiled_all_reduce(args.compile_backend)
    prof.watch(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    batches = SyntheticBatches(
        steps=args.steps, batch_size=args.batch_size, width=args.width, delay_s=delay["data"]
    )
    batches.delay_from_step = args.delay_from_step
    data = DataLoader(batches, batch_size=None)
    losses: list[float] = []
    start = time.perf_counter()
    for step, (x, y) in enumerate(prof.wrap_dataloader(data)):
        active = step >= args.delay_from_step
        model.forward_delay_s = delay["forward"] if active else 0.0
        model.backward_delay_s = delay["backward"] if active else 0.0
        with prof.step():
            with prof.section("forward"):
                loss = nn.functional.mse_loss(net(x), y)
            with prof.section("backward"):
                loss.backward()
                if sync_gradients is not None:
                    sync_gradients([p.grad for p in model.parameters() if p.grad is not None])
            with prof.section("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if delay["optimizer"] and active:
                    time.sleep(delay["optimizer"])
            prof.record(samples=x.shape[0], tokens=x.shape[0] * args.width)
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
        losses.append(loss.item())
    hexes = [v.hex() for v in losses]
    world = dist.group.WORLD
    assert world is not None
    return {
        "groups": {"world": {"name": world.group_name, "ranks": list(range(world.size()))}},
        "steps_trained": len(losses),
        "final_loss": losses[-1],
        "final_loss_hex": hexes[-1],
        "losses_hex": hexes,
        "params_hex": float(sum(p.detach().double().sum() for p in model.parameters())).hex(),
        "train_s": time.perf_counter() - start,
    }


def all_reduce_async(grads: list[torch.Tensor]) -> None:
    """Average gradients across ranks: every all-reduce issued (async_op=True), then waited on."""
    works = [dist.all_reduce(g, async_op=True) for g in grads]
    for work in works:
        work.wait()
    for g in grads:
        g.div_(dist.get_world_size())


def compiled_all_reduce(backend: str) -> Callable[[list[torch.Tensor]], None]:
    """Average gradients across ranks with one all-reduce of their concatenation, in a function
    compiled whole (fullgraph=True: dynamo turns dist.all_reduce into a functional collective)."""
    world_size = dist.get_world_size()

    @torch.compile(fullgraph=True, backend=backend)
    def all_reduce_mean(flat: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(flat)
        return flat / world_size

    def sync(grads: list[torch.Tensor]) -> None:
        flat = all_reduce_mean(torch.cat([g.reshape(-1) for g in grads]))
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    return sync


def train_allreduce(args: argparse.Namespace, prof: stepscope.Profiler) -> dict[str, float]:
    tensor = torch.ones(args.allreduce_numel)
    own_busy_s = 0.0
    for _ in range(args.steps):
        with prof.step():
            for _ in range(args.allreduce_per_step):
                start = time.perf_counter()
                dist.all_reduce(tensor)
                own_busy_s += time.perf_counter() - start
                tensor.fill_(1.0)
    return {
        "own_busy_s": own_busy_s,
        "bytes_per_call": tensor.numel() * tensor.element_size(),
        "calls": args.steps * args.allreduce_per_step,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.break_profiler:
        break_profiler()
    prof = (
        stepscope.Profiler()
        if args.no_stepscope
        else stepscope.init(
            job_id=args.job_id,
            url=args.url,
            flush_interval_s=args.flush_interval_s,
            spill_dir=args.spill_dir,
            attributes={"example": "ddp_train", "mode": args.mode},
        )
    )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"rank{rank}.started").touch()
    start = time.perf_counter()
    if args.mode != "allreduce":
        summary = train_ddp(args, prof, rank)
    else:
        summary = train_allreduce(args, prof)
    summary["train_s"] = time.perf_counter() - start
    prof.close()
    shipper = getattr(prof, "shipper", None)
    if shipper is not None:
        summary["bytes_sent"] = shipper.stats.num_bytes_sent
        summary["steps_sent"] = shipper.stats.num_rows_sent["steps"]
        summary["collectives_sent"] = shipper.stats.num_rows_sent["collectives"]
        summary["batches_sent"] = shipper.stats.num_batches_sent
        summary["dropped"] = shipper.stats.num_dropped
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo sometimes aborts in interpreter teardown


if __name__ == "__main__":
    main()
