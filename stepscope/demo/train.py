"""The demo's training job: a small transformer sharded with FSDP2 over gloo (CPU), with
trouble injected on purpose. Run by `stepscope demo` as a platform runs every job, profiled
with no code change (zero-code):

    stepscope run --url http://127.0.0.1:8000 --job-id demo -- \\
        python -m torch.distributed.run --standalone --nproc_per_node=4 --max-restarts 1 \\
        -m stepscope.demo.train --ckpt-dir DIR

Its loop calls no stepscope code: steps, sections, data wait and FSDP2's collectives are
inferred. It declares only what zero-code cannot know, through `stepscope.current()`: the
step it resumed from, that its `torch.save` calls are checkpoints, and tokens per step.

The trouble (the defaults of the flags): rank 1's data loader is slow in steps 20-59, rank 2
is slow in backward from step 60, a checkpoint is saved every 40 steps, rank 3 raises in
step 90 and torchrun restarts the job, which resumes from the checkpoint of step 80.

Each incarnation initialises gloo in a store prefix of its own (docs/goodput.md: a gloo job
restarted by torchrun otherwise reads the dead incarnation's addresses).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import stepscope
from stepscope.demo import PROGRESS_PREFIX


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ckpt-dir", required=True, help="where the checkpoint is written")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-s", type=float, default=0.05, help="extra compute per step, seconds")
    p.add_argument("--ckpt-every", type=int, default=40)
    p.add_argument("--data-rank", type=int, default=1)
    p.add_argument("--data-steps", default="20-59", help="FIRST-LAST: slow data loader steps")
    p.add_argument("--data-s", type=float, default=0.1, help="loader stall per step, seconds")
    p.add_argument("--backward-rank", type=int, default=2)
    p.add_argument("--backward-from-step", type=int, default=60)
    p.add_argument("--backward-s", type=float, default=0.1, help="backward delay, seconds")
    p.add_argument("--crash-rank", type=int, default=3)
    p.add_argument("--crash-step", type=int, default=90)
    return p.parse_args(argv)


class DemoModel(nn.Module):
    """Token embedding, a few transformer encoder layers (causal), an LM head."""

    def __init__(self, *, vocab_size: int, dim: int, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True)
            for _ in range(num_layers)
        )
        self.head = nn.Linear(dim, vocab_size)
        self.backward_delay_s = 0.0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        out = self.head(h).clone()  # not a view: FSDP2's pre-backward hook must hold
        if self.backward_delay_s and out.requires_grad:
            delay_s = self.backward_delay_s

            def sleep_then_pass(grad: torch.Tensor) -> torch.Tensor:
                time.sleep(delay_s)  # this rank's backward starts late
                return grad

            out.register_hook(sleep_then_pass)
        return out


class DemoBatches(IterableDataset[tuple[int, torch.Tensor]]):
    """(step, tokens) from `first_step` on; the data rank's loader stalls in its slow steps."""

    def __init__(
        self, args: argparse.Namespace, rank: int, first_step: int, vocab_size: int
    ) -> None:
        self.args, self.rank, self.first_step, self.vocab_size = args, rank, first_step, vocab_size

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        args = self.args
        first, last = (int(s) for s in args.data_steps.split("-"))
        gen = torch.Generator().manual_seed(self.rank)
        for step in range(self.first_step, args.steps):
            if self.rank == args.data_rank and first <= step <= last:
                time.sleep(args.data_s)
            yield step, torch.randint(self.vocab_size, (8, 33), generator=gen)


def init_process_group() -> tuple[int, int]:
    """Rank and restart count; gloo in this incarnation's store prefix."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store = dist.PrefixStore(
        f"incarnation{restart}/",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return rank, restart


def say(rank: int, message: str) -> None:
    if rank == 0:
        print(f"{PROGRESS_PREFIX} {message}", flush=True)  # noqa: T201  (read by the CLI)


def train(args: argparse.Namespace, rank: int, restart: int) -> None:
    """Train from the last checkpoint, with the injected trouble."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    vocab_size = 64
    model = DemoModel(vocab_size=vocab_size, dim=32, num_layers=2)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = stepscope.current()  # zero-code's (started by the optimizer), or a no-op
    ckpt = Path(args.ckpt_dir) / f"rank{rank}.pt"
    first_step = 0
    if ckpt.exists():
        with prof.phase("checkpoint_load"):
            state = torch.load(ckpt, weights_only=False)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            first_step = int(state["step"])
        prof.resumed_from(first_step)
        say(rank, f"restart {restart}: resumed from the checkpoint of step {first_step}")
    loader = DataLoader(DemoBatches(args, rank, first_step, vocab_size), batch_size=None)
    for step, tokens in loader:
        if step % args.ckpt_every == 0 and step != first_step:
            with prof.phase("checkpoint_save"):
                # Each rank saves its shards: the state before `step`, resumed at `step`.
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": step}, ckpt)
                dist.barrier()
            say(rank, f"checkpoint saved at step {step}")
        model.backward_delay_s = (
            args.backward_s
            if rank == args.backward_rank and step >= args.backward_from_step
            else 0.0
        )
        logits = model(tokens[:, :-1])
        prof.record(tokens=tokens[:, :-1].numel())
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, vocab_size), tokens[:, 1:].reshape(-1)
        )
        if restart == 0 and rank == args.crash_rank and step == args.crash_step:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        loss.backward()
        time.sleep(args.step_s)  # the compute a real model would do on a GPU
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        say(rank, f"step {step}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, restart = init_process_group()
    # An exception (the crash) is reported by zero-code, which closes the profiler as the
    # process ends (os._exit included): what is buffered and, on rank 0, the final status.
    train(args, rank, restart)
    say(rank, "done")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo sometimes aborts in interpreter teardown


if __name__ == "__main__":
    main()
