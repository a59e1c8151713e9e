"""A tiny transformer trained with FSDP2 (fully_shard per block, then the root) on CPU/gloo,
profiled by stepscope; --wrap fsdp1 trains it with FullyShardedDataParallel instead.

    torchrun --standalone --nproc_per_node=4 examples/fsdp2_train.py --url http://127.0.0.1:8000

`--delay-rank 2 --delay-phase forward --delay-s 0.03` makes rank 2 a compute straggler:
its peers wait for it in the all-gathers; `--delay-phase data` makes it a data straggler (its
DataLoader sleeps before each batch). Without --url (or STEPSCOPE_URL) the profiler is a
no-op; --no-stepscope leaves stepscope out entirely.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformer import (
    DELAY_PHASES,
    Block,
    add_common_args,
    build_model,
    delay_for,
    group_info,
    lm_loss,
    mesh_groups,
    model_config,
    run_main,
    summary,
    token_loader,
)

import stepscope


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p, delay_phases=DELAY_PHASES)
    p.add_argument("--wrap", choices=("fully_shard", "fsdp1"), default="fully_shard")
    return p.parse_args(argv)


def shard(model: nn.Module, wrap: str) -> tuple[nn.Module, dict[str, dict[str, Any]]]:
    """The model sharded over all ranks (FSDP2 on a 1-D "dp_shard" mesh, or FSDP1), and the
    process groups it communicates in."""
    if wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
        )
        return wrapped, {"world": group_info()}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for block in model.blocks.values():  # type: ignore[operator]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh_groups(mesh)


def train(args: argparse.Namespace, prof: stepscope.Profiler) -> dict[str, Any]:
    rank = dist.get_rank()
    cfg = model_config(args)
    model = build_model(cfg)
    sharded, groups = shard(model, args.wrap)
    prof.watch(sharded)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    delay_at = delay_for(args, rank)
    losses: list[float | None] = []
    start = time.perf_counter()
    data = token_loader(
        cfg, steps=args.steps, batch_size=args.batch_size, seed=rank, delay=model.delay
    )
    for step, (tokens, targets) in enumerate(prof.wrap_dataloader(data)):
        model.delay.arm(args.delay_phase, delay_at(step))
        with prof.step():
            with prof.section("forward"):
                loss = lm_loss(sharded(tokens), targets)
            with prof.section("backward"):
                loss.backward()
            with prof.section("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            prof.record(samples=tokens.shape[0], tokens=tokens.numel())
        losses.append(loss.item())
    return summary(losses, sharded, time.perf_counter() - start, groups)


if __name__ == "__main__":
    run_main(parse_args(), "fsdp2_train", train)
