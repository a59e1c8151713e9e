"""A torchrun job for the hang tests: training that stalls on cue, on gloo and CPU.

`--scenario main` (4 ranks): a slow first step, a checkpoint phase on rank 0, rank 2 asleep
in its data loader, rank 3 frozen by SIGSTOP (the test sends SIGCONT), then rank 1 calling
all_gather where its peers call all_reduce (the job then hangs until the test ends it).
`--scenario pipeline` (3 ranks): GPipe stages; stage 1 stalls in its forward for good.
`--scenario stall` (benchmarks/hang_detection.py): steps of --step-s; rank 2 stalls in its data
loader for good at step 10.
`--scenario stop` (2 ranks): rank 1 stops itself with SIGSTOP at step 8 (the test sends SIGCONT),
and the job runs to its end.
Each rank writes {when each stall began, its pid} to OUT/rank{r}.json as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import stepscope

STEP_S = 0.03
SLOW_FIRST_STEP_S = 4.0
CHECKPOINT_AT, CHECKPOINT_S = 8, 60.0
DATA_STALL_AT, DATA_STALL_RANK, DATA_STALL_S = 16, 2, 7.0
FREEZE_AT, FREEZE_RANK = 24, 3
MISMATCH_AT, MISMATCH_RANK = 32, 1
PIPELINE_STALL_AT, PIPELINE_STALL_STAGE = 8, 1
STALL_AT = 10
STOP_AT, STOP_RANK, STOP_NUM_STEPS = 8, 1, 16


class Marks:
    """What this rank tells the test: its pid, and when each stall began (epoch s)."""

    def __init__(self, out: Path, rank: int) -> None:
        self._path = out / f"rank{rank}.json"
        self.doc: dict[str, Any] = {"pid": os.getpid()}
        self._write()

    def mark(self, name: str) -> None:
        self.doc[name] = time.time()
        self._write()

    def _write(self) -> None:
        temporary = self._path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.doc))
        os.replace(temporary, self._path)


def sleeps_in_the_data_loader(seconds: float) -> None:
    time.sleep(seconds)


def batches(rank: int, marks: Marks) -> Iterator[torch.Tensor]:
    """The data loader: rank 2 sleeps in it before the batch of step DATA_STALL_AT."""
    step = 0
    while True:
        if step == DATA_STALL_AT and rank == DATA_STALL_RANK:
            marks.mark("data_stall")
            sleeps_in_the_data_loader(DATA_STALL_S)
        yield torch.ones(64)
        step += 1


def main_scenario(prof: stepscope.Profiler, rank: int, marks: Marks, num_steps: int) -> None:
    loader = batches(rank, marks)
    for step in range(num_steps):
        if step == CHECKPOINT_AT:
            with prof.phase("checkpoint_save"):
                marks.mark("checkpoint")
                time.sleep(CHECKPOINT_S if rank == 0 else 0.2)
        with prof.step():
            with prof.section("data"):
                batch = next(loader)
            with prof.section("forward"):
                if step == 0 and rank == 0:
                    marks.mark("slow_first_step")
                    time.sleep(SLOW_FIRST_STEP_S)
                time.sleep(STEP_S)
                if step == FREEZE_AT and rank == FREEZE_RANK:
                    marks.mark("freeze")
                    os.kill(os.getpid(), signal.SIGSTOP)  # the test sends SIGCONT
                    marks.mark("thawed")
            with prof.section("backward"):
                if step == MISMATCH_AT:
                    marks.mark("mismatch")
                    if rank == MISMATCH_RANK:
                        out = torch.empty(batch.numel() * dist.get_world_size())
                        dist.all_gather_into_tensor(out, batch)
                    else:
                        dist.all_reduce(batch)
                    marks.mark("mismatch_passed")  # not expected: the job hangs here
                dist.all_reduce(batch)


def stall_scenario(prof: stepscope.Profiler, rank: int, marks: Marks, step_s: float) -> None:
    """Steps of `step_s` (one all_reduce each); rank DATA_STALL_RANK sleeps in its data
    loader before step STALL_AT until the job is ended."""
    for step in range(STALL_AT + 1):
        with prof.step():
            with prof.section("data"):
                if step == STALL_AT and rank == DATA_STALL_RANK:
                    marks.mark("data_stall")
                    sleeps_in_the_data_loader(3600.0)
            with prof.section("forward"):
                time.sleep(step_s)
            dist.all_reduce(torch.ones(64))


def stop_scenario(prof: stepscope.Profiler, rank: int, marks: Marks, num_steps: int) -> None:
    """Steps of STEP_S (one all_reduce each); rank STOP_RANK stops itself in the forward of
    step STOP_AT until the test sends SIGCONT."""
    for step in range(num_steps):
        with prof.step():
            with prof.section("forward"):
                time.sleep(STEP_S)
                if step == STOP_AT and rank == STOP_RANK:
                    marks.mark("freeze")
                    os.kill(os.getpid(), signal.SIGSTOP)
                    marks.mark("thawed")
            dist.all_reduce(torch.ones(64))


def stage_stalls_in_its_forward(seconds: float) -> None:
    time.sleep(seconds)


class Stage(nn.Module):
    def __init__(self, index: int, marks: Marks) -> None:
        super().__init__()
        self.index = index
        self.marks = marks
        self.linear = nn.Linear(16, 16)
        self.step = 0
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.step == PIPELINE_STALL_AT and self.index == PIPELINE_STALL_STAGE:
            self.marks.mark("stage_stall")
            stage_stalls_in_its_forward(600.0)
        return torch.relu(self.linear(x))


def pipeline_scenario(prof: stepscope.Profiler, rank: int, marks: Marks, num_steps: int) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(rank)
    module = Stage(rank, marks)
    stage = PipelineStage(module, rank, dist.get_world_size(), torch.device("cpu"))
    prof.watch(stage)
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.MSELoss())
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    for step in range(num_steps):
        module.step = step
        with prof.step(), prof.section("forward_backward"):
            if rank == 0:
                schedule.step(x)
            elif rank == dist.get_world_size() - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            # Every stage agrees on a figure each step (as loss logging does): a collective
            # the flight recorder keeps (gloo's send/recv are not kept).
            dist.all_reduce(torch.ones(1))
        time.sleep(STEP_S)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=("main", "pipeline", "stall", "stop"), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-s", type=float, default=1.0, help="the stall scenario's step time")
    p.add_argument("--hang-after-s", type=float, help="default: stepscope's adaptive threshold")
    p.add_argument("--heartbeat-s", type=float, help="default: stepscope's")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    marks = Marks(args.out, rank)
    settings = {"hang_after_s": args.hang_after_s, "heartbeat_s": args.heartbeat_s}
    prof = stepscope.init(**{k: v for k, v in settings.items() if v is not None})
    if args.scenario == "main":
        main_scenario(prof, rank, marks, args.steps)
    elif args.scenario == "stall":
        stall_scenario(prof, rank, marks, args.step_s)
    elif args.scenario == "stop":
        stop_scenario(prof, rank, marks, args.steps)
    else:
        pipeline_scenario(prof, rank, marks, args.steps)
    marks.mark("done")
    prof.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
