"""DDP timing: the bucket hook computes what DDP computes without one and times every bucket;
the step timer records one all-reduce per synchronising backward, with DDP's bucket count."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stepscope.profiler.collectives.calls import CollectiveCall
from stepscope.profiler.collectives.ddp import DdpStepTimer, make_ddp_hook
from stepscope.profiler.collectives.groups import GroupRegistry
from stepscope.profiler.timer import CpuClock
from tests.profiler.ranks import run_ranks

pytestmark = pytest.mark.torchrun

WORLD_SIZE = 3
NUM_STEPS = 3


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 300), nn.ReLU(), nn.Linear(300, 1000), nn.Linear(1000, 1))


def compare(rank: int, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        # A 1 MiB first bucket: this model's gradients need more than one bucket.
        plain = DistributedDataParallel(build_model())
        hooked = DistributedDataParallel(build_model())
        calls: list[CollectiveCall] = []
        hooked.register_comm_hook(
            hooked.process_group,
            make_ddp_hook(clock=CpuClock(), record=calls.append, groups=GroupRegistry()),
        )
        gen = torch.Generator().manual_seed(rank)  # ranks see different data
        identical = True
        for _ in range(NUM_STEPS):
            x = torch.randn(16, 64, generator=gen)
            for model in (plain, hooked):
                model.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
            for a, b in zip(plain.parameters(), hooked.parameters(), strict=True):
                assert a.grad is not None
                assert b.grad is not None
                identical = identical and torch.equal(a.grad, b.grad)
        queue.put(
            {
                "rank": rank,
                "identical": identical,
                "calls": [
                    (c.op, c.group.size, c.num_bytes, c.ddp_bucket, c.end is not None)
                    for c in calls
                ],
                "ordered": all(c.end is not None and c.end >= c.start for c in calls),
                "model_bytes": sum(p.numel() * p.element_size() for p in plain.parameters()),
            }
        )
    finally:
        dist.destroy_process_group()


def test_hooked_ddp_gradients_equal_plain_ddp_and_every_bucket_is_timed() -> None:
    results = run_ranks(compare, WORLD_SIZE)
    for result in results:
        # Bit-identical: the hook scales by 1/world size as DDP does when it has no hook.
        assert result["identical"]
        calls = result["calls"]
        assert {(op, size, bucket, done) for op, size, _, bucket, done in calls} == {
            ("all_reduce", WORLD_SIZE, True, True)
        }
        assert len(calls) > NUM_STEPS  # DDP rebuilds its buckets after step 1: two from then on
        assert sum(c[2] for c in calls) == NUM_STEPS * result["model_bytes"]
        assert result["ordered"]


class TwoHeads(nn.Module):
    """Returns a tuple: the step timer must time one backward through both outputs once."""

    def __init__(self) -> None:
        super().__init__()
        self.body = build_model()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.body(x)
        return y, 2 * y


def time_steps(rank: int, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        timed = DistributedDataParallel(TwoHeads())
        step_calls: list[CollectiveCall] = []
        timer = DdpStepTimer(
            timed, clock=CpuClock(), record=step_calls.append, groups=GroupRegistry()
        )
        hooked = DistributedDataParallel(TwoHeads())  # DDP's real buckets, one call each
        bucket_calls: list[CollectiveCall] = []
        hooked.register_comm_hook(
            hooked.process_group,
            make_ddp_hook(clock=CpuClock(), record=bucket_calls.append, groups=GroupRegistry()),
        )
        gen = torch.Generator().manual_seed(rank)
        per_step: list[tuple[int, int]] = []
        for step in range(NUM_STEPS + 2):
            x = torch.randn(16, 64, generator=gen)
            for model in (timed, hooked):
                if step == 1:  # gradient accumulation: no all-reduce in this backward
                    with model.no_sync():
                        a, b = model(x)
                        (a + b).square().mean().backward()
                with torch.no_grad():
                    model(x)  # an evaluation forward in between times nothing
                a, b = model(x)
                (a + b).square().mean().backward()
            per_step.append((len(step_calls), len(bucket_calls)))
        timer.remove()
        timed(x)[0].sum().backward()  # removed: no longer timed
        queue.put(
            {
                "rank": rank,
                "per_step": per_step,
                "calls": [
                    (c.op, c.group.size, c.num_bytes, c.ddp_bucket, c.count) for c in step_calls
                ],
                "ordered": all(c.end is not None and c.end >= c.start for c in step_calls),
                "bucket_bytes": sum(c.num_bytes for c in bucket_calls[-2:]),
                "num_step_calls": len(step_calls),
            }
        )
    finally:
        dist.destroy_process_group()


def test_step_timer_records_one_all_reduce_per_synchronising_backward() -> None:
    for result in run_ranks(time_steps, WORLD_SIZE):
        # One call per synchronising backward; DDP's own buckets: 1 on step 0, 2 once rebuilt.
        assert result["per_step"] == [(1, 1), (2, 3), (3, 5), (4, 7), (5, 9)]
        assert result["num_step_calls"] == NUM_STEPS + 2
        # The count is DDP's bucket count after its rebuild (two here), bytes all gradients.
        assert set(result["calls"]) == {("all_reduce", WORLD_SIZE, result["bucket_bytes"], True, 2)}
        assert result["ordered"]


class SkipsFirst(nn.Module):
    """Its first parameter gets no gradient in odd steps (DDP needs find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.body = build_model()

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        return self.body(x if skip else self.first(x))


def time_unused(rank: int, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        handles = {}
        calls: list[CollectiveCall] = []
        for name, unused in (("default", False), ("find_unused", True)):
            model = DistributedDataParallel(SkipsFirst(), find_unused_parameters=unused)
            timer = DdpStepTimer(
                model, clock=CpuClock(), record=calls.append, groups=GroupRegistry()
            )
            handles[name] = len(timer._handles)
        gen = torch.Generator().manual_seed(rank)
        for step in range(NUM_STEPS + 1):
            model(torch.randn(8, 64, generator=gen), skip=step % 2 == 1).sum().backward()
        queue.put({"rank": rank, "handles": handles, "num_calls": len(calls)})
    finally:
        dist.destroy_process_group()


def test_step_timer_watches_a_second_parameter_only_where_one_may_get_no_gradient() -> None:
    for result in run_ranks(time_unused, 2):
        # Default DDP: every parameter gets a gradient in every step, one hook is enough.
        assert result["handles"] == {"default": 1, "find_unused": 2}
        # Steps whose first parameter got no gradient are timed by the last one's hook.
        assert result["num_calls"] == NUM_STEPS + 1
