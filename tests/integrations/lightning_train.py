"""A Lightning job that never imports stepscope: a small MLP on random data, one rank made
slow in training_step from a given step on (tests/integrations/test_lightning_torchrun.py).

Every training_step sleeps `--step-sleep-s`, standing in for device time: the rank waits
without using a core, so that the steps are long enough for a delay to stand well above the
noise of ranks sharing two busy cores, yet cheap.

Under torchrun, Lightning's "ddp" strategy takes the ranks torchrun started; alone, it is one
process (--devices 1).
"""

from __future__ import annotations

import argparse
import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SlowRankMLP(pl.LightningModule):
    """An MLP whose `delay_rank` sleeps `delay_s` in training_step from `delay_from_step` on."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        width = args.width
        self.net = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()
        )
        self.head = nn.Linear(width, 1)
        self.args = args
        num_params = sum(p.numel() for p in self.parameters())
        self.flops_per_batch = 6 * num_params * args.batch_size
        """ThroughputMonitor's convention: model FLOPs of one batch on one device."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        args = self.args
        sleep_s = args.step_sleep_s
        if self.global_rank == args.delay_rank and self.trainer.global_step >= args.delay_from_step:
            sleep_s += args.delay_s
        time.sleep(sleep_s)
        x, y = batch
        return nn.functional.mse_loss(self.head(self.net(x)).squeeze(-1), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.head(self.net(x)).squeeze(-1), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(num_samples: int, args: argparse.Namespace) -> DataLoader[tuple[torch.Tensor, ...]]:
    data = TensorDataset(torch.randn(num_samples, args.width), torch.randn(num_samples))
    return DataLoader(data, batch_size=args.batch_size)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--steps-per-epoch", type=int, default=50)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--delay-rank", type=int, default=-1)
    p.add_argument("--delay-from-step", type=int, default=0)
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--checkpoint-dir", default=None, help="save a checkpoint every 5 steps here")
    args = p.parse_args()
    torch.manual_seed(0)
    callbacks = []
    if args.checkpoint_dir is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.checkpoint_dir, every_n_train_steps=5, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp" if args.devices > 1 else "auto",
        devices=args.devices,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=args.checkpoint_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    per_epoch = args.steps_per_epoch * args.accumulate * args.batch_size * args.devices
    trainer.fit(
        SlowRankMLP(args),
        train_dataloaders=loader(per_epoch, args),
        val_dataloaders=loader(2 * args.batch_size * args.devices, args),
    )


if __name__ == "__main__":
    main()
