"""The collective tap never breaks training and sees every collective, per process group:
pipeline parallelism (whose P2POp checks the identity of dist.isend/irecv) and
torch.compile(fullgraph=True) of code that calls a collective run as they do without it;
FSDP2's, tensor parallelism's, async and compiled collectives are recorded with their group,
sequence number, bytes and exposed wait; an error inside the tap turns it off, and only it."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stepscope.profiler.collectives.calls import CollectiveCall
from stepscope.profiler.collectives.groups import GroupRegistry
from stepscope.profiler.collectives.tap import CollectiveTap
from stepscope.profiler.timer import CpuClock
from tests.profiler.ranks import run_ranks

pytestmark = pytest.mark.torchrun

NUM_STEPS = 3


def _init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)


def _tap(calls: list[CollectiveCall], groups: GroupRegistry | None = None) -> CollectiveTap:
    tap = CollectiveTap(clock=CpuClock(), calls=calls, groups=groups or GroupRegistry())
    tap.install()
    return tap


def _summary(calls: list[CollectiveCall]) -> list[tuple[Any, ...]]:
    """What the tests compare: op, group, size, bytes, sequence, waited, completed."""
    return [
        (c.op, c.group.name, c.group.size, c.num_bytes, c.seq, c.wait_s > 0, c.end is not None)
        for c in calls
    ]


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
        calls: list[CollectiveCall] = []
        tap = _tap(calls)
        try:
            tapped = _pipeline_losses(rank)
        except Exception as exc:  # what the test is about: report it rather than hang a peer
            queue.put({"rank": rank, "error": repr(exc)})
            return
        finally:
            tap.remove()
        p2p = Counter((c.op, c.num_bytes, c.seq, c.end is not None) for c in calls)
        queue.put({"rank": rank, "error": None, "plain": plain, "tapped": tapped, "p2p": p2p})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_pipeline_parallel_training_runs_unchanged_with_the_tap_installed() -> None:
    results = run_ranks(pipeline, 2)
    assert [r["error"] for r in results] == [None, None]
    last_stage = results[1]
    assert len(last_stage["plain"]) == NUM_STEPS * 2  # two micro-batches a step
    assert last_stage["tapped"] == last_stage["plain"]  # bit-identical losses
    # Each micro-batch (2 of 4 samples) sends 16 activations forward, and their gradients back;
    # the first step also exchanges the stages' shapes (small objects, once each).
    activation_bytes = 2 * 16 * 4
    for result in results:
        p2p = result["p2p"]
        assert p2p[("send", activation_bytes, None, True)] == NUM_STEPS * 2
        assert p2p[("recv", activation_bytes, None, True)] == NUM_STEPS * 2
        once = {key: n for key, n in p2p.items() if key[1] != activation_bytes}
        assert set(once.values()) == {1}
        assert {op for op, *_ in once} == {"send", "recv"}


def _all_reduce_twice(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t * 2


def compiled(rank: int, port: int, queue: Any) -> None:
    _init(rank, port)
    calls: list[CollectiveCall] = []
    tap = _tap(calls)
    try:
        explained = torch._dynamo.explain(_all_reduce_twice)(torch.ones(4))
        fn = torch.compile(_all_reduce_twice, fullgraph=True, backend="aot_eager")
        fn(torch.ones(4))  # compiles
        calls.clear()
        out = fn(torch.full((4,), float(rank + 1)))
    except Exception as exc:  # what the test is about: report it rather than hang
        queue.put({"rank": rank, "error": repr(exc)})
        return
    finally:
        tap.remove()
    queue.put(
        {
            "rank": rank,
            "error": None,
            "breaks": explained.graph_break_count,
            "out": out.tolist(),
            "calls": _summary(calls),
        }
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
        # The compiled graph's functional all-reduce, waited on by its wait_tensor.
        [(op, group, size, num_bytes, _, waited, done)] = result["calls"]
        assert (op, group, size, num_bytes, waited, done) == ("all_reduce", "0", 2, 16, True, True)


LAYER_SIZES = ((16, 32), (32, 32), (32, 4))


def _fsdp2_steps(rank: int, calls: list[CollectiveCall] | None) -> list[float]:
    """NUM_STEPS steps of a model whose three Linear layers are each fully_shard-ed; losses."""
    from torch.distributed.fsdp import fully_shard

    tap = _tap(calls) if calls is not None else None
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
        if tap is not None:
            tap.remove()


def fsdp2(rank: int, port: int, queue: Any) -> None:
    _init(rank, port)
    try:
        plain = _fsdp2_steps(rank, None)
        calls: list[CollectiveCall] = []
        tapped = _fsdp2_steps(rank, calls)
        counts = Counter((c.op, c.num_bytes, c.group.size) for c in calls)
        seqs = [c.seq for c in calls]
        waited = all(c.wait_s > 0 and c.end is not None for c in calls)
        queue.put(
            {
                "rank": rank,
                "same": tapped == plain,
                "counts": dict(counts),
                "seqs": seqs,
                "waited": waited,
            }
        )
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
    results = run_ranks(fsdp2, 2)
    for result in results:
        assert result["same"]  # bit-identical losses with the tap
        assert result["counts"] == expected
        assert result["waited"]  # synchronous: every one was waited on
    # One sequence per group, the same on both ranks: calls match across ranks by it.
    assert results[0]["seqs"] == results[1]["seqs"] == list(range(1, 9 * NUM_STEPS + 1))


def _tensor_parallel_step(tap_calls: list[CollectiveCall] | None) -> list[float]:
    """A tensor-parallel MLP (Colwise then Rowwise over a 1-D "tp" mesh): forward+backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    groups = GroupRegistry()
    groups.add_mesh(mesh)
    tap = _tap(tap_calls, groups) if tap_calls is not None else None
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if tap_calls is not None:
            tap_calls.clear()  # parallelize_module broadcasts the seed; count the step only
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = model(x)
        out.sum().backward()
        assert x.grad is not None
        return [float(out.sum()), float(x.grad.sum())]
    finally:
        if tap is not None:
            tap.remove()


def tensor_parallel_and_async(rank: int, port: int, queue: Any) -> None:
    _init(rank, port)
    try:
        plain = _tensor_parallel_step(None)
        calls: list[CollectiveCall] = []
        tapped = _tensor_parallel_step(calls)
        tp_calls = _summary(calls)
        calls.clear()
        tap = _tap(calls)
        try:
            t = torch.ones(256)
            if rank == 1:
                time.sleep(0.2)  # rank 0 waits for rank 1
            work = dist.all_reduce(t, async_op=True)
            returned = work.wait()
        finally:
            tap.remove()
        [call] = calls
        queue.put(
            {
                "rank": rank,
                "same": plain == tapped,
                "tp": tp_calls,
                "async": (call.op, call.num_bytes, call.seq, t[0].item(), returned),
                "wait_s": call.wait_s,
                "busy_s": call.end - call.start,
            }
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_and_async_collectives_are_recorded_with_their_exposed_wait() -> None:
    results = run_ranks(tensor_parallel_and_async, 2)
    for result in results:
        assert result["same"]  # the same outputs and input gradients with the tap
        # Forward: RowwiseParallel all-reduces the (4, 8) output; backward: ColwiseParallel
        # all-reduces the (4, 8) input gradient. Functional collectives in the "tp" group.
        assert [c[:4] for c in result["tp"]] == [("all_reduce", "0", 2, 4 * 8 * 4)] * 2
        assert all(waited and done for *_, waited, done in result["tp"])
        assert result["async"] == ("all_reduce", 256 * 4, 1, 2.0, True)
    late, waiting = results[1], results[0]
    assert waiting["wait_s"] >= 0.15  # rank 0 sat in wait() until rank 1 arrived
    assert late["wait_s"] < 0.1
    assert waiting["busy_s"] - late["busy_s"] >= 0.15  # busy − min busy: who was waited for


def broken_tap(rank: int, port: int, queue: Any) -> None:
    _init(rank, port)
    try:
        calls: list[CollectiveCall] = []
        errors: list[str] = []
        groups = GroupRegistry()
        tap = CollectiveTap(
            clock=CpuClock(),
            calls=calls,
            groups=groups,
            on_error=lambda e: errors.append(repr(e)),
        )
        tap.install()
        try:
            t = torch.ones(4)
            dist.all_reduce(t)
            groups.by_id.clear()  # the group is looked up again, and the lookup fails:
            groups.of = lambda pg: 1 / 0  # type: ignore[method-assign]  # the injected bug
            dist.all_reduce(t)
            dist.all_reduce(t, async_op=True).wait()
        finally:
            tap.remove()
        from torch._C._distributed_c10d import ProcessGroup, Work

        restored = (
            all(
                not getattr(ProcessGroup.__dict__[name], "__qualname__", "").startswith(
                    "ProcessGroup."
                )
                for name in ("allreduce", "send", "all_gather_single")
            )
            and type(Work.__dict__["wait"]).__name__ == "instancemethod"
        )
        queue.put(
            {
                "rank": rank,
                "sum": t.tolist(),
                "errors": errors,
                "enabled": tap.enabled,
                "recorded": len(calls),
                "restored": restored,
            }
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_an_error_inside_the_tap_turns_it_off_and_the_collectives_still_run() -> None:
    for result in run_ranks(broken_tap, 2):
        assert result["sum"] == [8.0] * 4  # three all-reduces of ones over two ranks
        assert result["errors"] == ["ZeroDivisionError('division by zero')"]  # said once
        assert (result["enabled"], result["recorded"]) == (False, 1)
        assert result["restored"]


def overlapped_async(rank: int, port: int, queue: Any) -> None:
    _init(rank, port)
    try:
        calls: list[CollectiveCall] = []
        tap = _tap(calls)
        try:
            t = torch.ones(64)
            if rank == 1:
                time.sleep(0.2)  # rank 0's all-reduce completes 0.2 s after it is issued
            work = dist.all_reduce(t, async_op=True)
            tap.observe()  # a section boundary: the work is in flight, its completion is timed
            time.sleep(0.5)  # the caller's own work, which the transfer overlaps
            wait_start = time.perf_counter()
            work.wait()
            unwaited = dist.all_reduce(torch.ones(8), async_op=True)  # never waited
            while not unwaited.is_completed():  # the peer may issue it late on a busy machine
                time.sleep(0.01)
            tap.observe()  # the next boundary sees it completed
            unwaited.get_future().wait()
        finally:
            tap.remove()
        overlapped, dropped = calls
        assert overlapped.wait_s > 0
        assert overlapped.end is not None
        queue.put(
            {
                "rank": rank,
                "busy_s": overlapped.end - overlapped.start,
                "ended_before_wait": overlapped.end <= wait_start,
                "dropped_ended": dropped.end is not None and dropped.wait_s == 0.0,
                "completed_seq": overlapped.group.completed_seq,
            }
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_async_work_overlapping_the_callers_own_work_ends_when_it_completes() -> None:
    waiting, late = run_ranks(overlapped_async, 2)
    # Rank 0's transfer took the 0.2 s until rank 1 joined, not the 0.5 s until its wait.
    assert all(r["ended_before_wait"] for r in (waiting, late))
    assert 0.15 <= waiting["busy_s"] < 0.45
    assert late["busy_s"] < waiting["busy_s"] - 0.1  # busy − min busy: who was waited for
    assert all(r["dropped_ended"] for r in (waiting, late))
    assert waiting["completed_seq"] == late["completed_seq"] == 2
