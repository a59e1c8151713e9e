"""GPU check for a lent machine (H100/H200/...): event timing, NVML/GPM sampling and MFU.

    .venv/bin/python benchmarks/gpu_check.py [--seconds 4] [--dim 8192]

1. Times a bf16 matmul step with torch.cuda.Event pairs (no synchronize in the loop) and
   with perf_counter + synchronize, and says how far apart they are.
2. Samples NVML (and GPM where supported) through GpuSampler while the GPU is busy and
   prints the rows.
3. Measures FLOPs of a bf16 MLP training step with FlopCounterMode and prints MFU against
   peak_flops_for(device name).
4. Runs the DDP step timer (comm_timing="step") on CUDA with NCCL, one rank: one
   all-reduce record per step, its comm_wait_s from CUDA events.

Without CUDA it says so and exits 0. It takes about half a minute on an H200.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from stepscope.profiler.telemetry.flops import measure_flops, mfu, peak_flops_for
from stepscope.profiler.telemetry.nvml import GpuSampler


def event_vs_sync_timing(torch: Any, dim: int, steps: int) -> None:
    a = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()

    pairs = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(steps)
    ]
    host_start = time.perf_counter()
    for start, end in pairs:
        start.record()
        a @ b
        end.record()
    enqueue_s = time.perf_counter() - host_start
    done_before_sync = sum(end.query() for _, end in pairs)
    torch.cuda.synchronize()
    event_s = [start.elapsed_time(end) / 1e3 for start, end in pairs]

    sync_s = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        sync_s.append(time.perf_counter() - t0)

    flops = 2.0 * dim**3
    event_med, sync_med = statistics.median(event_s), statistics.median(sync_s)
    print(f"== matmul {dim}x{dim}x{dim} bf16, {steps} steps")
    for label, median_s in (("cuda events", event_med), ("perf_counter + sync", sync_med)):
        tflops = flops / median_s / 1e12
        print(f"  {label + ':':<21} median {median_s * 1e3:8.3f} ms  ({tflops:.1f} TFLOP/s)")
    print(f"  sync - events:        {(sync_med - event_med) * 1e6:8.1f} us per step")
    print(
        f"  host time to enqueue {steps} steps with events: {enqueue_s * 1e3:.2f} ms "
        f"({done_before_sync}/{steps} already complete by query() before synchronize)"
    )


def nvml_sampling(torch: Any, seconds: float, dim: int) -> None:
    rows: list[dict[str, Any]] = []
    # NVML counts devices in PCI order; with CUDA_VISIBLE_DEVICES set the indices may differ.
    sampler = GpuSampler.create(interval_s=0.5, device=0, emit=rows.append)
    print(f"== NVML sampling for {seconds:.0f} s under matmul load")
    if sampler is None:
        print("  GpuSampler.create returned None (see the log line above)")
        return
    print(f"  GPM supported: {sampler.gpm_supported}")
    a = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
    sampler.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    sampler.stop()
    columns = (
        "util",
        "mem_used_bytes",
        "power_w",
        "temp_c",
        "sm_clock_mhz",
        "throttle_reasons",
        "sm_active",
        "tensor_active",
        "dram_active",
        "nvlink_tx_bps",
        "pcie_rx_bps",
    )
    print("  " + " ".join(f"{c:>16}" for c in columns))
    for row in rows:
        print("  " + " ".join(f"{_fmt(row[c]):>16}" for c in columns))
    print(
        f"  {len(rows)} rows; null fields per row: "
        f"{sorted({k for r in rows for k, v in r.items() if v is None})}"
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def mlp_mfu(torch: Any, dim: int, steps: int) -> None:
    num_layers, batch = 4, 8192
    layers = [torch.nn.Linear(dim, dim, bias=False) for _ in range(num_layers)]
    model = torch.nn.Sequential(*layers).to(device="cuda", dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        optimizer.step()

    flops_per_step = measure_flops(train_step)
    # 2 forward + 4 backward per weight, less the input gradient that layer 1 does not need.
    analytic = 6.0 * batch * dim * dim * num_layers - 2.0 * batch * dim * dim
    for _ in range(3):
        train_step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        train_step()
    end.record()
    end.synchronize()
    step_s = start.elapsed_time(end) / 1e3 / steps

    name = torch.cuda.get_device_name()
    peak = peak_flops_for(name)
    print(f"== MFU: {num_layers}-layer bf16 MLP, dim {dim}, batch {batch}, {steps} steps")
    print(
        f"  FLOPs/step measured {flops_per_step:.4e}, analytic (6L-2)*B*d^2 {analytic:.4e}"
        f" (ratio {flops_per_step / analytic:.4f})"
    )
    print(f"  step {step_s * 1e3:.3f} ms -> {flops_per_step / step_s / 1e12:.1f} TFLOP/s achieved")
    if peak is None:
        print(f"  peak unknown for {name!r}: no MFU (peak_unknown)")
    else:
        achieved = mfu(flops_per_step, step_s, peak)
        print(f"  peak {peak / 1e12:.0f} TFLOP/s ({name}) -> MFU {achieved:.3f}")


def ddp_step_timer(torch: Any, dim: int, steps: int) -> None:
    import os

    import torch.distributed as dist

    from stepscope.profiler.collectives.ddp import CollectiveCall, DdpStepTimer
    from stepscope.profiler.timer import CudaClock

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(4)]).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        clock = CudaClock()
        calls: list[CollectiveCall] = []
        timer = DdpStepTimer(ddp, clock=clock, record=calls.append)
        x = torch.randn(1024, dim, device="cuda")
        host_start = time.perf_counter()
        for _ in range(steps):
            ddp(x).float().pow(2).mean().backward()
        host_s = time.perf_counter() - host_start
        torch.cuda.synchronize()
        timer.remove()
        waits_ms = [clock.seconds_between(c.start, c.end) * 1e3 for c in calls]
        print(f"== DDP step timer on CUDA (NCCL, 1 rank), 4 x Linear({dim}), {steps} steps")
        print(
            f"  records {len(calls)} (expected {steps}); buckets {calls[0].count}, "
            f"bytes {calls[0].num_bytes}; host loop {host_s * 1e3:.1f} ms"
        )
        print(
            f"  comm_wait_s from events: median {statistics.median(waits_ms):.3f} ms, "
            f"min {min(waits_ms):.3f}, max {max(waits_ms):.3f}"
        )
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="NVML sampling duration")
    parser.add_argument("--dim", type=int, default=8192, help="matmul / hidden size")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_check needs torch with CUDA; torch is not installed. Nothing to check.")
        return 0
    if not torch.cuda.is_available():
        print(
            "gpu_check needs a CUDA GPU; torch.cuda.is_available() is False here. Nothing to check."
        )
        return 0
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    name = torch.cuda.get_device_name()
    print(
        f"device: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"peak_flops_for -> {peak_flops_for(name)}"
    )
    event_vs_sync_timing(torch, args.dim, args.steps)
    nvml_sampling(torch, args.seconds, args.dim)
    mlp_mfu(torch, args.dim, args.steps)
    ddp_step_timer(torch, args.dim // 2, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
