"""A torchrun job for the deep-capture tests (#21): DDP on gloo and CPU whose rank 2 is
slowed inside `slow_rank_two_delay`, training until the test says stop.

Every step rank 0 reads OUT/stop and broadcasts it, so all ranks stop after the same step.
Each rank writes {pid, num_steps, the model's weights} to OUT/rank{r}.json at the end.
`--break-profiler` makes torch.profiler raise when a capture starts (a capture that fails).
The data and the initial weights are fixed, so the test can recompute the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import stepscope

WIDTH = 16
SLOW_RANK = 2
DELAY_S = 0.04
MAX_STEPS = 5000
LEARNING_RATE = 0.01


def slow_rank_two_delay() -> None:
    """The culprit's extra work: its name is what the test looks for in the trace."""
    time.sleep(DELAY_S)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's batch of `step`, the same in every run."""
    generator = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(8, WIDTH, generator=generator)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def build_model() -> nn.Linear:
    """The model with fixed initial weights."""
    torch.manual_seed(0)
    return nn.Linear(WIDTH, 1)


def break_the_profiler() -> None:
    from torch.profiler import profile

    def refuse(self: profile) -> None:
        raise OSError(28, "No space left on device (simulated)")

    profile.start = refuse  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--break-profiler", action="store_true")
    args = parser.parse_args()
    if args.break_profiler:
        break_the_profiler()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    prof = stepscope.init(flush_interval_s=0.5)
    prof.watch(model)
    stop = torch.zeros(1)
    step = 0
    while step < MAX_STEPS:
        with prof.step():
            x, y = batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            if rank == SLOW_RANK:
                slow_rank_two_delay()
            optimizer.step()
        step += 1
        stop[0] = 1.0 if rank == 0 and (args.out / "stop").exists() else 0.0
        dist.broadcast(stop, src=0)
        if stop.item():
            break
    prof.close()
    weights = [p.detach().flatten().tolist() for p in model.module.parameters()]
    doc = {"pid": os.getpid(), "num_steps": step, "weights": weights}
    (args.out / f"rank{rank}.json").write_text(json.dumps(doc))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
