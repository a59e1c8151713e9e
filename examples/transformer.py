"""What the transformer examples share: a tiny causal transformer, synthetic token batches
(and a DataLoader of them), injected delays, the command-line flags and the per-rank summary.

fsdp2_train.py, fsdp_tp_train.py and pipeline_train.py import this module (it sits next to
them, so `torchrun examples/<name>.py` finds it); tests import the examples the same way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import stepscope

DELAY_PHASES = ("data", "forward", "backward")
"""Where a Delay sleeps; "data" only in examples that read through token_loader."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    vocab_size: int = 64
    dim: int = 32
    num_heads: int = 4
    num_layers: int = 4
    seq_len: int = 16
    hidden_mult: int = 4
    """MLP hidden width, in multiples of dim."""

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError("dim must be a multiple of num_heads")


def add_common_args(
    p: argparse.ArgumentParser,
    *,
    steps: int = 30,
    delay_phases: Sequence[str] = ("forward", "backward"),
) -> None:
    """The flags every transformer example takes (as examples/ddp_train.py has them)."""
    p.add_argument("--steps", type=int, default=steps, help="training steps")
    p.add_argument("--url", default=None, help="collector URL (else STEPSCOPE_URL)")
    p.add_argument("--job-id", default=None, help="job id (else STEPSCOPE_JOB_ID / torchrun's)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--delay-rank", type=int, default=-1, help="rank that gets the delay")
    p.add_argument("--delay-phase", choices=delay_phases, default="backward")
    p.add_argument("--delay-s", type=float, default=0.0, help="delay per step, seconds")
    p.add_argument(
        "--delay-step-ratio",
        type=float,
        default=0.0,
        help="delay at least this times the median step before --delay-from-step",
    )
    p.add_argument("--delay-from-step", type=int, default=0, help="first delayed step")
    p.add_argument("--flush-interval-s", type=float, default=0.5)
    p.add_argument("--no-stepscope", action="store_true", help="train without stepscope at all")
    p.add_argument("--out", default=None, help="directory for a per-rank JSON summary")


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        dim=args.dim, num_heads=args.num_heads, num_layers=args.num_layers, seq_len=args.seq_len
    )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.num_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds num_heads / tp of them.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in self.qkv())
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.wq, self.wk, self.wv


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_mult * cfg.dim)
        self.w2 = nn.Linear(cfg.hidden_mult * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """A causal LM; a pipeline stage keeps only its blocks (and the embedding or the head)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keeps block names (and FQNs) when a pipeline stage deletes the others.
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.dim)
        self.head: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size)
        self.delay = Delay()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.delay.before_forward()
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = block(h)
        if self.norm is not None and self.head is not None:
            h = self.head(self.norm(h))
        return self.delay.in_backward_of(h)


class Delay:
    """Sleeps before a batch (see TokenBatches), in forward or in backward while armed: makes
    this rank a data or a compute straggler."""

    def __init__(self) -> None:
        self.data_s = 0.0
        self.forward_s = 0.0
        self.backward_s = 0.0

    def arm(self, phase: str, delay_s: float) -> None:
        self.data_s = delay_s if phase == "data" else 0.0
        self.forward_s = delay_s if phase == "forward" else 0.0
        self.backward_s = delay_s if phase == "backward" else 0.0

    def before_batch(self) -> None:
        if self.data_s:
            time.sleep(self.data_s)

    def before_forward(self) -> None:
        if self.forward_s:
            time.sleep(self.forward_s)

    def in_backward_of(self, out: torch.Tensor) -> torch.Tensor:
        if self.backward_s and out.requires_grad:
            delay_s = self.backward_s

            def sleep_then_pass(grad: torch.Tensor) -> torch.Tensor:
                time.sleep(delay_s)  # backward starts late on this rank
                return grad

            out.register_hook(sleep_then_pass)
        return out


def build_model(cfg: ModelConfig) -> Transformer:
    """The same initial weights on every rank and in every run."""
    torch.manual_seed(0)
    return Transformer(cfg)


def token_batches(
    cfg: ModelConfig, *, steps: int, batch_size: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, next tokens) batches; equal seeds give equal batches (TP peers share a seed)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
        yield tokens[:, :-1], tokens[:, 1:]


class TokenBatches(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """token_batches, read through a DataLoader as a real job's input is; each batch comes
    after `delay`'s data delay. The loop arms the delay at the start of a step, after drawing
    its batch: a data delay armed at step i slows the batch of step i + 1."""

    def __init__(
        self, cfg: ModelConfig, *, steps: int, batch_size: int, seed: int, delay: Delay
    ) -> None:
        self.cfg = cfg
        self.steps = steps
        self.batch_size = batch_size
        self.seed = seed
        self.delay = delay

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batches = token_batches(
            self.cfg, steps=self.steps, batch_size=self.batch_size, seed=self.seed
        )
        for batch in batches:
            self.delay.before_batch()
            yield batch


def token_loader(
    cfg: ModelConfig, *, steps: int, batch_size: int, seed: int, delay: Delay
) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    """A DataLoader of TokenBatches in this process (batch_size=None: they come batched)."""
    dataset = TokenBatches(cfg, steps=steps, batch_size=batch_size, seed=seed, delay=delay)
    return DataLoader(dataset, batch_size=None, num_workers=0)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def delay_for(args: argparse.Namespace, rank: int) -> Callable[[int], float]:
    """step -> this rank's injected delay at that step (0 when not delayed), called once at
    the start of every step: --delay-s, or --delay-step-ratio times the median of the rank's
    steps before --delay-from-step (step 0 left out) if that is longer. A machine that runs
    the steps slower runs them noisier too: a delay relative to them stands out as much."""
    delayed = rank == args.delay_rank and (args.delay_s > 0 or args.delay_step_ratio > 0)
    starts_s: list[float] = []
    delay_s = args.delay_s

    def at(step: int) -> float:
        nonlocal delay_s
        if not delayed:
            return 0.0
        if step <= args.delay_from_step and args.delay_step_ratio > 0:
            starts_s.append(time.perf_counter())
        if step < args.delay_from_step:
            return 0.0
        if len(starts_s) > 2:  # the first delayed step: the steps before it are timed
            step_s = statistics.median(b - a for a, b in itertools.pairwise(starts_s[1:]))
            delay_s = max(delay_s, args.delay_step_ratio * step_s)
            starts_s.clear()
        return delay_s

    return at


def params_checksum(model: nn.Module) -> str:
    """float.hex of the sum of this rank's (local) parameter values: equal iff trained alike."""
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.detach().double().sum()
    return float(total).hex()


def group_info(group: Any = None) -> dict[str, Any]:
    """A process group's name (as stepscope stores it) and global ranks; None: the world."""
    group = group if group is not None else dist.group.WORLD
    return {"name": group.group_name, "ranks": dist.get_process_group_ranks(group)}


def mesh_groups(mesh: Any) -> dict[str, dict[str, Any]]:
    """group_info of this rank's group along each named dim of a DeviceMesh (from the sliced
    mesh, `mesh[name]`, which is what parallelize_module and fully_shard are given)."""
    return {name: group_info(mesh[name].get_group()) for name in mesh.mesh_dim_names}


def summary(
    losses: list[float | None],
    model: nn.Module,
    train_s: float,
    groups: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """What a run reports: its losses (float.hex, bit-exact), final loss, a weights checksum
    and the process groups it communicated in."""
    hexes = [None if v is None else float(v).hex() for v in losses]
    return {
        "groups": groups,
        "losses_hex": hexes,
        "final_loss_hex": hexes[-1] if hexes else None,
        "final_loss": losses[-1] if losses else None,
        "params_hex": params_checksum(model),
        "train_s": train_s,
    }


def start_profiler(args: argparse.Namespace, example: str) -> stepscope.Profiler:
    """stepscope.init (or, with --no-stepscope, the no-op profiler and no stepscope code at all)."""
    if args.no_stepscope:
        return stepscope.Profiler()
    return stepscope.init(
        job_id=args.job_id,
        url=args.url,
        flush_interval_s=args.flush_interval_s,
        attributes={"example": example},
    )


def run_main(
    args: argparse.Namespace,
    example: str,
    train: Callable[[argparse.Namespace, stepscope.Profiler], dict[str, Any]],
) -> None:
    """init the gloo group and the profiler, train, close, write --out, and exit cleanly."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    prof = start_profiler(args, example)
    result = train(args, prof)
    prof.close()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo sometimes aborts in interpreter teardown
