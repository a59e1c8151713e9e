"""A tiny transformer trained with pipeline parallelism (torch.distributed.pipelining) on
CPU/gloo, one stage per rank, profiled by stepscope.

    torchrun --standalone --nproc_per_node=4 examples/pipeline_train.py --schedule 1f1b

The blocks are split evenly into world-size stages (the first also holds the embedding, the
last the final norm and head); ScheduleGPipe or Schedule1F1B runs --microbatches microbatches
a step. A --delay-rank stage sleeps --delay-s a step (spread over its microbatches) in forward
or backward; the other stages wait for it in their sends and receives.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from transformer import (
    Transformer,
    add_common_args,
    build_model,
    delay_for,
    group_info,
    lm_loss,
    model_config,
    run_main,
    summary,
    token_batches,
)

import stepscope


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--microbatches", type=int, default=4)
    return p.parse_args(argv)


def stage_module(model: Transformer, stage: int, num_stages: int) -> Transformer:
    """`model` cut down to this stage's blocks (in place)."""
    names = list(model.blocks.keys())
    if len(names) % num_stages:
        raise ValueError(f"{len(names)} blocks do not split into {num_stages} stages")
    per_stage = len(names) // num_stages
    keep = set(names[stage * per_stage : (stage + 1) * per_stage])
    for name in names:
        if name not in keep:
            del model.blocks[name]
    if stage > 0:
        model.embed = None
    if stage < num_stages - 1:
        model.norm = model.head = None
    return model


def train(args: argparse.Namespace, prof: stepscope.Profiler) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, num_stages = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args)
    model = stage_module(build_model(cfg), rank, num_stages)
    stage = PipelineStage(model, rank, num_stages, torch.device("cpu"))
    prof.watch(stage)
    schedule_cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(stage, n_microbatches=args.microbatches, loss_fn=lm_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    delay_at = delay_for(args, rank)
    first, last = rank == 0, rank == num_stages - 1
    losses: list[float | None] = []
    start = time.perf_counter()
    # Every stage draws the same batches: the first feeds the tokens, the last the targets.
    batches = token_batches(cfg, steps=args.steps, batch_size=args.batch_size, seed=0)
    for step, (tokens, targets) in enumerate(batches):
        model.delay.arm(args.delay_phase, delay_at(step) / args.microbatches)
        with prof.step():
            microbatch_losses: list[torch.Tensor] = []
            with prof.section("forward_backward"):
                if first:
                    schedule.step(tokens)
                elif last:
                    schedule.step(target=targets, losses=microbatch_losses)
                else:
                    schedule.step()
            with prof.section("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            prof.record(samples=tokens.shape[0], tokens=tokens.numel())
        losses.append(torch.stack(microbatch_losses).mean().item() if last else None)
    return summary(losses, model, time.perf_counter() - start, {"world": group_info()})


if __name__ == "__main__":
    run_main(parse_args(), "pipeline_train", train)
