"""The collective tap (CollectivePatch) never breaks training: pipeline parallelism, whose
P2POp checks the identity of dist.isend/irecv, and torch.compile(fullgraph=True) of code that
calls a collective, run as they do without it."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stepscope.profiler.comm import CollectivePatch
from stepscope.profiler.timer import CpuClock
from tests.profiler.ranks import run_ranks

pytestmark = pytest.mark.torchrun

NUM_STEPS = 3


def _init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)


def _pipeline_losses(rank: int) -> list[float]:
    """NUM_STEPS GPipe steps of a 2-stage model (this rank is one stage); the last stage's
    micro-batch losses."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    part = model[:2] if rank == 0 else model[2:]
    stage = PipelineStage(part, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.MSELoss())
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses: list[float] = []
    for _ in range(NUM_STEPS):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=step_losses)
            losses += [loss.item() for loss in step_losses]
        optimizer.step()
    return losses


def pipeline(rank: int, port: int, queue: Any) -> None:
    _init(rank, port)
    try:
        plain = _pipeline_losses(rank)
        patch = CollectivePatch(clock=CpuClock(), record=lambda _: None)
        patch.install()
        try:
            tapped = _pipeline_losses(rank)
        except Exception as exc:  # what the test is about: report it rather than hang a peer
            queue.put({"rank": rank, "error": repr(exc)})
            return
        finally:
            patch.remove()
        queue.put({"rank": rank, "error": None, "plain": plain, "tapped": tapped})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_pipeline_parallel_training_runs_unchanged_with_the_tap_installed() -> None:
    results = run_ranks(pipeline, 2)
    assert [r["error"] for r in results] == [None, None]
    last_stage = results[1]
    assert len(last_stage["plain"]) == NUM_STEPS * 2  # two micro-batches a step
    assert last_stage["tapped"] == last_stage["plain"]  # bit-identical losses


def _all_reduce_twice(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t * 2


def compiled(rank: int, port: int, queue: Any) -> None:
    _init(rank, port)
    patch = CollectivePatch(clock=CpuClock(), record=lambda _: None)
    patch.install()
    try:
        explained = torch._dynamo.explain(_all_reduce_twice)(torch.ones(4))
        fn = torch.compile(_all_reduce_twice, fullgraph=True, backend="aot_eager")
        out = fn(torch.full((4,), float(rank + 1)))
    except Exception as exc:  # what the test is about: report it rather than hang
        queue.put({"rank": rank, "error": repr(exc)})
        return
    finally:
        patch.remove()
    queue.put(
        {"rank": rank, "error": None, "breaks": explained.graph_break_count, "out": out.tolist()}
    )
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_compiled_function_calling_all_reduce_compiles_whole_with_the_tap_installed() -> None:
    results = run_ranks(compiled, 2, timeout_s=240)
    assert [r["error"] for r in results] == [None, None]
    for result in results:
        assert result["breaks"] == 0
        assert result["out"] == [6.0] * 4  # (1 + 2) summed over both ranks, then doubled
