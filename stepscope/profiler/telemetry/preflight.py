"""Preflight: before training, measure every rank's all-reduce bandwidth and matmul speed.

A rank whose matmul FLOP/s or bus bandwidth is far below the median of all ranks is
reported, so a bad GPU, node or link is found before it slows a long job down.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from stepscope.schema import busbw_bps

logger = logging.getLogger(__name__)

KIB = 1024
MIB = 1024 * KIB
DEFAULT_SIZES_BYTES = (KIB, 16 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)

TEST_SLOW_RANK_ENV = "STEPSCOPE_PREFLIGHT_TEST_SLOW_RANK"
"""Test hook: the rank named here makes its matmul probe TEST_SLOWDOWN times slower (sleeps)."""
TEST_SLOWDOWN = 10.0


class EventSink(Protocol):
    """What preflight needs of the profiler: `Profiler.event`."""

    def event(self, kind: str, message: str, **attributes: Any) -> None: ...


@dataclass(kw_only=True, slots=True)
class SlowRank:
    """A rank whose probe measured far below the median of all ranks."""

    rank: int
    node: str
    metric: str
    """`matmul_flops` (FLOP/s) or `busbw_bps` (bytes/s, at the largest message size)."""
    observed: float
    expected: float
    """Median over all ranks."""

    @property
    def ratio(self) -> float:
        return self.observed / self.expected if self.expected > 0 else float("nan")


@dataclass(kw_only=True, slots=True)
class PreflightResult:
    """What the preflight measured, per message size and per rank."""

    world_size: int
    backend: str
    sizes_bytes: list[int]
    busbw_bps: list[float]
    """All-reduce bus bandwidth per size: median over ranks, bytes/s."""
    rank_busbw_bps: list[list[float]]
    """Per rank, per size: the bus bandwidth that rank measured, bytes/s."""
    rank_matmul_flops: list[float]
    """Per rank: matmul FLOP/s."""
    rank_nodes: list[str]
    matmul_n: int
    slow_fraction: float
    slow_ranks: list[SlowRank] = field(default_factory=list)


def run_preflight(
    *,
    prof: EventSink | None = None,
    sizes_bytes: tuple[int, ...] = DEFAULT_SIZES_BYTES,
    iters: int = 5,
    matmul_n: int | None = None,
    matmul_iters: int = 10,
    slow_fraction: float = 0.7,
) -> PreflightResult:
    """Run the probes on every rank of the default process group; every rank gets the result.

    `matmul_n` defaults to 4096 (bf16) on CUDA and 512 (fp32) on CPU. A rank is slow when a
    probe gives less than `slow_fraction` × the median of all ranks.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "run_preflight needs an initialised torch.distributed process group: "
            "call torch.distributed.init_process_group() first, or run "
            "`torchrun ... -m stepscope.preflight`"
        )
    if not sizes_bytes or iters < 1 or matmul_iters < 1 or not 0 < slow_fraction < 1:
        raise ValueError("need sizes_bytes, iters >= 1, matmul_iters >= 1, 0 < slow_fraction < 1")

    backend = str(dist.get_backend())
    device = _device(torch, backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if matmul_n is None:
        matmul_n = 4096 if device.type == "cuda" else 512

    own_busbw = [_allreduce_busbw(torch, dist, device, size, iters) for size in sizes_bytes]
    own_flops = _matmul_flops(torch, dist, device, matmul_n, matmul_iters, rank)

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (own_busbw, own_flops, socket.gethostname()))
    rank_busbw = [list(g[0]) for g in gathered]
    result = PreflightResult(
        world_size=world_size,
        backend=backend,
        sizes_bytes=list(sizes_bytes),
        busbw_bps=[statistics.median(r[i] for r in rank_busbw) for i in range(len(sizes_bytes))],
        rank_busbw_bps=rank_busbw,
        rank_matmul_flops=[float(g[1]) for g in gathered],
        rank_nodes=[str(g[2]) for g in gathered],
        matmul_n=matmul_n,
        slow_fraction=slow_fraction,
    )
    result.slow_ranks = _slow_ranks(result)
    _report(result, rank, prof)
    return result


def _device(torch: Any, backend: str) -> Any:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allreduce_busbw(torch: Any, dist: Any, device: Any, size_bytes: int, iters: int) -> float:
    """This rank's all-reduce bus bandwidth at one message size, bytes/s."""
    tensor = torch.ones(max(1, size_bytes // 4), dtype=torch.float32, device=device)
    num_bytes = tensor.numel() * tensor.element_size()
    dist.all_reduce(tensor)  # warm-up: connection setup and allocation are not bandwidth
    _sync(torch, device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    _sync(torch, device)
    elapsed_s = (time.perf_counter() - start) / iters
    return busbw_bps("all_reduce", dist.get_world_size(), num_bytes, elapsed_s)


def _matmul_flops(torch: Any, dist: Any, device: Any, n: int, iters: int, rank: int) -> float:
    """This rank's matmul FLOP/s on an n×n×n product (bf16 on CUDA, fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.matmul(a, b)
    _sync(torch, device)
    # All ranks start together so that no rank is measured while a peer idles beside it.
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    _sync(torch, device)
    elapsed_s = time.perf_counter() - start
    if os.environ.get(TEST_SLOW_RANK_ENV) == str(rank):
        time.sleep(elapsed_s * (TEST_SLOWDOWN - 1))
        elapsed_s *= TEST_SLOWDOWN
    return 2.0 * n**3 * iters / elapsed_s


def _slow_ranks(result: PreflightResult) -> list[SlowRank]:
    probes = {
        "matmul_flops": result.rank_matmul_flops,
        "busbw_bps": [per_size[-1] for per_size in result.rank_busbw_bps],
    }
    slow = []
    for metric, values in probes.items():
        median = statistics.median(values)
        for rank, value in enumerate(values):
            if value < result.slow_fraction * median:
                slow.append(
                    SlowRank(
                        rank=rank,
                        node=result.rank_nodes[rank],
                        metric=metric,
                        observed=value,
                        expected=median,
                    )
                )
    return slow


def _report(result: PreflightResult, rank: int, prof: EventSink | None) -> None:
    """Rank 0 logs the findings; each slow rank records an event about itself."""
    for slow in result.slow_ranks:
        message = (
            f"preflight: rank {slow.rank} on {slow.node} is slow: {slow.metric} "
            f"{slow.observed:.3g} is {slow.ratio:.2f}x the median {slow.expected:.3g}"
        )
        if rank == 0:
            logger.warning(message)
        if prof is not None and slow.rank == rank:
            prof.event(
                "custom",
                message,
                check="preflight",
                metric=slow.metric,
                observed=slow.observed,
                expected=slow.expected,
                ratio=slow.ratio,
            )
    if prof is not None and rank == 0:
        prof.event(
            "custom",
            f"preflight: {len(result.slow_ranks)} slow rank(s) of {result.world_size}",
            check="preflight",
            world_size=result.world_size,
            backend=result.backend,
            sizes_bytes=result.sizes_bytes,
            busbw_bps=result.busbw_bps,
            rank_matmul_flops=result.rank_matmul_flops,
            slow_ranks=sorted({s.rank for s in result.slow_ranks}),
        )
