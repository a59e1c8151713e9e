"""A plain PyTorch training script that never imports stepscope: profile it with

    stepscope run -- python examples/plain_train.py
    stepscope run -- torchrun --standalone --nproc_per_node=2 examples/plain_train.py

(docs/integrations.md). Under torchrun it trains with DDP over gloo; alone, on one process.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="optimizer updates")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per update")
    args = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    num_batches = args.steps * args.accumulate
    x = torch.randn(num_batches * 32, 64)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)
    model.train()
    for i, (inputs, targets) in enumerate(loader):
        loss = nn.functional.mse_loss(model(inputs), targets) / args.accumulate
        loss.backward()
        if (i + 1) % args.accumulate == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    print(f"final loss {loss.item() * args.accumulate:.4f}")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
