"""A CPU DDP (gloo) run that checkpoints, fails on one rank and is restarted by torchrun:
what goodput accounting sees (docs/goodput.md).

    torchrun --standalone --nproc_per_node=4 --max-restarts 1 examples/restart_train.py \\
        --url http://127.0.0.1:8000 --ckpt-dir /tmp/ckpt --fail-rank 2 --fail-step 50

Each incarnation initialises gloo in a store prefix of its own: with torch 2.13 a gloo job
restarted by torchrun otherwise fails in connectFullMesh ("Connection refused"), reading the
dead incarnation's addresses from the agent's store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import stepscope
from stepscope.profiler.lifecycle import process_start_time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="collector URL (else STEPSCOPE_URL)")
    p.add_argument("--job-id", default=None)
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--step-sleep-s", type=float, default=0.02)
    p.add_argument("--out", default=None, help="folder for what each process measured")
    return p.parse_args()


def init_process_group() -> tuple[int, int, int]:
    """Rank, world size, restart count; gloo in this incarnation's store prefix."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store = dist.PrefixStore(
        f"incarnation{restart}/",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return rank, world_size, restart


def main() -> None:
    args = parse_args()
    started_at = process_start_time()
    rank, _, restart = init_process_group()
    out = Path(args.out) if args.out else None
    try:
        train(args, rank, restart, started_at, out)
    finally:
        if out is not None:  # when this process was last alive, for the restart test
            (out / f"end-{restart}-{rank}.json").write_text(json.dumps({"ts": time.time()}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def train(
    args: argparse.Namespace, rank: int, restart: int, started_at: float | None, out: Path | None
) -> None:
    """Train from the last checkpoint; the failing rank raises in its failing step."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = Path(args.ckpt_dir) / "ckpt.pt"
    if out is not None:
        (out / f"start-{restart}-{rank}.json").write_text(json.dumps({"started_at": started_at}))
    with stepscope.init(job_id=args.job_id, url=args.url, flush_interval_s=0.2) as prof:
        prof.watch(model)
        first_step = 0
        if ckpt.exists():
            with prof.phase("checkpoint_load"):
                state = torch.load(ckpt)
                model.module.load_state_dict(state["model"])
                first_step = state["step"]
            prof.resumed_from(first_step)
        for step in range(first_step, args.steps):
            if step % args.ckpt_every == 0 and step != first_step:
                with prof.phase("checkpoint_save"):
                    if rank == 0:
                        # The state before `step`: a run resumed from it starts at `step`.
                        torch.save({"model": model.module.state_dict(), "step": step}, ckpt)
                    dist.barrier()
            with prof.step(step):
                x = torch.randn(32, 64)
                loss = model(x).pow(2).mean()
                if restart == 0 and rank == args.fail_rank and step == args.fail_step:
                    if out is not None:
                        (out / "failed.json").write_text(json.dumps({"ts": time.time()}))
                    raise RuntimeError(f"injected failure at step {step}")
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                time.sleep(args.step_sleep_s)


if __name__ == "__main__":
    main()
