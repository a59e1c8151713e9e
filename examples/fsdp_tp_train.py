"""A tiny transformer trained 2-D (FSDP2 over "dp_shard" x tensor parallel over "tp") on
CPU/gloo, profiled by stepscope.

    torchrun --standalone --nproc_per_node=4 examples/fsdp_tp_train.py --url http://127.0.0.1:8000

The mesh is init_device_mesh("cpu", (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"));
attention and MLP Linears are parallelize_module'd Colwise (wq, wk, wv, w1) / Rowwise (wo, w2)
over "tp", then every block and the root are fully_shard'ed over "dp_shard". `--dp-shard 1`
is tensor parallelism alone (no FSDP), over all ranks.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformer import (
    add_common_args,
    build_model,
    delay_for,
    group_info,
    lm_loss,
    mesh_groups,
    model_config,
    run_main,
    summary,
    token_batches,
)

import stepscope


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    p.add_argument("--dp-shard", type=int, default=2, help="FSDP degree; tp = world / dp-shard")
    return p.parse_args(argv)


def parallelize(model: nn.Module, dp_shard: int) -> Any:
    """Shard `model` in place over a (dp_shard, tp) mesh; the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = dist.get_world_size() // dp_shard
    mesh = init_device_mesh("cpu", (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))
    plan = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(),
    }
    for block in model.blocks.values():  # type: ignore[operator]
        parallelize_module(block, mesh["tp"], plan)
    if dp_shard > 1:
        for block in model.blocks.values():  # type: ignore[operator]
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    return mesh


def train(args: argparse.Namespace, prof: stepscope.Profiler) -> dict[str, Any]:
    rank = dist.get_rank()
    cfg = model_config(args)
    model = build_model(cfg)
    mesh = parallelize(model, args.dp_shard)
    prof.watch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    delay_at = delay_for(args, rank)
    losses: list[float | None] = []
    start = time.perf_counter()
    # TP peers compute on the same batch: the data follows the dp_shard coordinate.
    dp_index = mesh.get_local_rank("dp_shard")
    batches = token_batches(cfg, steps=args.steps, batch_size=args.batch_size, seed=dp_index)
    for step, (tokens, targets) in enumerate(batches):
        model.delay.arm(args.delay_phase, delay_at(step))
        with prof.step():
            with prof.section("forward"):
                loss = lm_loss(model(tokens), targets)
            with prof.section("backward"):
                loss.backward()
            with prof.section("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            prof.record(samples=tokens.shape[0], tokens=tokens.numel())
        losses.append(loss.item())
    # The tp groups are those the DTensor parameters use: torch hands a second mesh of the same
    # layout in one process the first one's (fully_shard uses the new dp_shard groups).
    used_mesh: Any = model.blocks["0"].attn.wq.weight.device_mesh  # type: ignore[union-attr]
    groups = mesh_groups(mesh) | {"tp": group_info(used_mesh.get_group("tp"))}
    return summary(losses, model, time.perf_counter() - start, groups)


if __name__ == "__main__":
    run_main(parse_args(), "fsdp_tp_train", train)
