"""FLOPs counting, the peak table and MFU."""

from __future__ import annotations

import functools
import math
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stepscope
from stepscope.profiler.telemetry.flops import PEAK_BF16_FLOPS, measure_flops, mfu, peak_flops_for
from tests.profiler.http_sink import http_sink
from tests.profiler.ranks import run_ranks


@pytest.mark.parametrize(
    ("device_name", "peak_flops"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA GB200", 2500e12),
        ("AMD Instinct MI300X", 1307e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA GeForce RTX 4090", 165.2e12),
    ],
)
def test_peak_flops_matches_names_as_torch_prints_them(device_name: str, peak_flops: float) -> None:
    assert peak_flops_for(device_name) == peak_flops


@pytest.mark.parametrize(
    "device_name", ["cpu", "", "NVIDIA L40", "NVIDIA A10G", "NVIDIA H100", "Tesla V100-SXM2-16GB"]
)
def test_unknown_devices_have_no_peak(device_name: str) -> None:
    assert peak_flops_for(device_name) is None


def test_every_table_entry_is_reachable_by_a_name_it_matches() -> None:
    # A pattern shadowed by an earlier, broader one would silently give the wrong peak.
    names = {
        r"\bGB200\b": "NVIDIA GB200",
        r"\bB200\b": "NVIDIA B200",
        r"\bGH200\b": "NVIDIA GH200 480GB",
        r"\bH200 NVL\b": "NVIDIA H200 NVL",
        r"\bH200\b": "NVIDIA H200",
        r"\bH100 NVL\b": "NVIDIA H100 NVL",
        r"\bH100 PCIe\b": "NVIDIA H100 PCIe",
        r"\bH100\b.*\b(HBM3|SXM5?)\b": "NVIDIA H100 SXM5 80GB",
        r"\bA100\b": "NVIDIA A100-PCIE-40GB",
        r"\bA40\b": "NVIDIA A40",
        r"\bA10\b": "NVIDIA A10",
        r"\bL40S\b": "NVIDIA L40S",
        r"\bL4\b": "NVIDIA L4",
        r"\bRTX 4090\b": "NVIDIA GeForce RTX 4090",
        r"\bMI325X\b": "AMD Instinct MI325X",
        r"\bMI300X\b": "AMD Instinct MI300X",
        r"\bMI250X\b": "AMD Instinct MI250X",
    }
    assert set(names) == set(PEAK_BF16_FLOPS)
    for pattern, name in names.items():
        assert peak_flops_for(name) == PEAK_BF16_FLOPS[pattern], name


def test_measured_flops_of_a_linear_training_step_are_six_b_in_out() -> None:
    batch, d_in, d_out = 8, 32, 16
    model = torch.nn.Linear(d_in, d_out, bias=False)
    x = torch.randn(batch, d_in, requires_grad=True)

    def step() -> None:
        model(x).sum().backward()

    # forward 2·B·in·out, backward 2·B·in·out for the input grad + 2·B·in·out for the weight grad
    assert measure_flops(step) == 6 * batch * d_in * d_out


def test_forward_only_flops_are_two_b_in_out() -> None:
    model = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        flops = measure_flops(lambda: model(torch.randn(4, 64)))
    assert flops == 2 * 4 * 64 * 8


def test_mfu_is_achieved_over_peak() -> None:
    assert mfu(4.0e14, 1.0, 989e12) == pytest.approx(0.40445, rel=1e-4)
    assert mfu(1e12, 0.5, 4e12) == 0.5


@pytest.mark.parametrize(("step_s", "peak_flops"), [(0.0, 1e12), (-1.0, 1e12), (1.0, 0.0)])
def test_mfu_is_nan_without_a_positive_time_or_peak(step_s: float, peak_flops: float) -> None:
    assert math.isnan(mfu(1e12, step_s, peak_flops))


def test_cpu_attention_is_counted_with_backward_twice_forward() -> None:
    batch, num_heads, seq, head_dim = 2, 4, 8, 16
    q, k, v = (torch.randn(batch, num_heads, seq, head_dim, requires_grad=True) for _ in range(3))
    attention = torch.nn.functional.scaled_dot_product_attention
    # Q·Kᵀ and P·V, 2·s·s·head_dim FLOPs each per head
    forward_flops = 2 * 2 * batch * num_heads * seq * seq * head_dim
    with torch.no_grad():
        assert measure_flops(lambda: attention(q, k, v)) == forward_flops
    assert measure_flops(lambda: attention(q, k, v).sum().backward()) == 3 * forward_flops


def test_fused_gpu_attention_backward_is_counted_without_its_recompute() -> None:
    # No GPU here: the formula is applied to meta tensors of the kernel's argument shapes.
    # FlopCounterMode counts 5 matmuls (the kernel recomputes Q·Kᵀ); model FLOPs count 4.
    from stepscope.profiler.telemetry.flops import _model_flop_formulas

    q = torch.empty(2, 4, 8, 16, device="meta")
    formulas = _model_flop_formulas()
    aten = torch.ops.aten
    forward = formulas[aten._scaled_dot_product_flash_attention](q, q, q)
    assert forward == 2 * 2 * 2 * 4 * 8 * 8 * 16
    for backward in (
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_cudnn_attention_backward,
    ):
        assert formulas[backward](q, q, q, q) == 2 * forward, backward


# A small transformer block, one rank's step of it, and its FLOPs counted by hand. The
# profiler's flops_per_step="auto" must report, on every rank, the FLOPs that rank executes.

VOCAB, DIM, NUM_HEADS, FFN_DIM = 64, 32, 4, 64
BATCH, SEQ = 2, 8
NUM_STEPS = 3
CASES = ("single", "ddp", "fsdp2", "tp")


class Block(nn.Module):
    """Embedding, attention (q, k, v, o), MLP (up, down) with residuals, and an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.up = nn.Linear(DIM, FFN_DIM, bias=False)
        self.down = nn.Linear(FFN_DIM, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        batch, seq, _ = x.shape
        # -1 heads: under TP each rank holds NUM_HEADS / 2 of them
        q, k, v = (
            proj(x).view(batch, seq, -1, DIM // NUM_HEADS).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        attended = F.scaled_dot_product_attention(q, k, v)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, seq, -1))
        x = x + self.down(F.relu(self.up(x)))
        return self.head(x)


def hand_count_flops(*, tp_degree: int = 1) -> int:
    """FLOPs of one training step of Block on one rank's BATCH×SEQ tokens.

    Forward is 2·m·n·k per matmul; backward is twice that, as every matmul needs both its
    input's gradient (the embedding's output requires grad) and its weight's. TP splits
    q, k, v, o, up and down, and the heads, evenly across ranks; the head is replicated.
    """
    tokens = BATCH * SEQ
    split_weights = 4 * DIM * DIM + 2 * DIM * FFN_DIM
    linear = 2 * tokens * (split_weights // tp_degree + DIM * VOCAB)
    attention = 2 * 2 * BATCH * SEQ * SEQ * DIM // tp_degree  # Q·Kᵀ and P·V over all heads
    return 3 * (linear + attention)


def _parallelize(case: str, model: Block) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    if case == "single":
        return model
    if case == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (2,))
    if case == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.q, model.k, model.v, model.o, model.up, model.down, model.head):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {name: ColwiseParallel() for name in ("q", "k", "v", "up")}
    plan |= {name: RowwiseParallel() for name in ("o", "down")}
    return parallelize_module(model, mesh, plan)


def profiled_rank(case: str, url: str, rank: int, port: int, queue: Any) -> None:
    world_size = 1 if case == "single" else 2
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = _parallelize(case, Block())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # TP ranks must see the same batch; data-parallel ranks each have their own.
    gen = torch.Generator().manual_seed(0 if case == "tp" else rank)
    prof = stepscope.init(
        job_id=f"flops-{case}", url=url, model=model, flops_per_step="auto", flush_interval_s=0.2
    )
    for _ in range(NUM_STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        with prof.step():
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    queue.put({"rank": rank})
    queue.close()
    queue.join_thread()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.torchrun
@pytest.mark.parametrize(
    ("case", "expected_flops"),
    [
        ("single", hand_count_flops()),
        # Each rank runs its own batch on unsharded (all-gathered) parameters or replicas.
        ("ddp", hand_count_flops()),
        ("fsdp2", hand_count_flops()),
        # Each rank multiplies its half of the split weights; torch's own FlopCounterMode
        # counts the DTensor matmuls at global shapes, as if each rank did all of them.
        ("tp", hand_count_flops(tp_degree=2)),
    ],
)
def test_auto_flops_are_what_each_rank_executes(case: str, expected_flops: int) -> None:
    world_size = 1 if case == "single" else 2
    with http_sink() as sink:
        run_ranks(functools.partial(profiled_rank, case, sink.url), world_size, timeout_s=240)
    flops_by_rank: dict[int, list[float]] = {}
    for body in sink.accepted():
        if "steps" in body:
            flops_by_rank.setdefault(body["source"]["rank"], []).extend(body["steps"]["flops"])
    assert flops_by_rank == {rank: [expected_flops] * NUM_STEPS for rank in range(world_size)}
