"""The collective tap (CollectivePatch) never breaks training: pipeline parallelism, whose
P2POp checks the identity of dist.isend/irecv, and torch.compile(fullgraph=True) of code that
calls a collective, run as they do without it; FSDP2's collectives are recorded."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stepscope.profiler.comm import CollectiveCall, CollectivePatch
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


LAYER_SIZES = ((16, 32), (32, 32), (32, 4))


def _fsdp2_steps(rank: int, calls: list[CollectiveCall] | None) -> list[float]:
    """NUM_STEPS steps of a model whose three Linear layers are each fully_shard-ed; losses."""
    from torch.distributed.fsdp import fully_shard

    patch = None
    if calls is not None:
        patch = CollectivePatch(clock=CpuClock(), record=calls.append)
        patch.install()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(i, o) for i, o in LAYER_SIZES))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(NUM_STEPS):
            optimizer.zero_grad()
            loss = model(torch.randn(8, LAYER_SIZES[0][0], generator=gen)).square().mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses
    finally:
        if patch is not None:
            patch.remove()


def fsdp2(rank: int, port: int, queue: Any) -> None:
    _init(rank, port)
    try:
        plain = _fsdp2_steps(rank, None)
        calls: list[CollectiveCall] = []
        tapped = _fsdp2_steps(rank, calls)
        counts = Counter((c.op, c.num_bytes, c.group_size) for c in calls)
        queue.put({"rank": rank, "same": tapped == plain, "counts": dict(counts)})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_all_gathers_and_reduce_scatters_are_recorded_with_their_bytes() -> None:
    # Per step, each layer's parameters are all-gathered for forward and again for backward
    # (reshard_after_forward), and its gradients reduce-scattered; 4-byte floats.
    expected = {}
    for fan_in, fan_out in LAYER_SIZES:
        layer_bytes = (fan_in * fan_out + fan_out) * 4
        expected[("all_gather", layer_bytes, 2)] = 2 * NUM_STEPS
        expected[("reduce_scatter", layer_bytes, 2)] = NUM_STEPS
    for result in run_ranks(fsdp2, 2):
        assert result["same"]  # bit-identical losses with the tap
        assert result["counts"] == expected
