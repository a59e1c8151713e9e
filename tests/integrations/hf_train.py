"""A tiny Llama trained by the Hugging Face Trainer under torchrun (CPU, gloo DDP), one rank made
slower in forward from a given step: the job the transformers adapter's tests profile.

    torchrun --standalone --nproc_per_node=4 tests/integrations/hf_train.py --out DIR [--callback]

With --callback the Trainer gets `callbacks=[StepscopeCallback()]` by hand (profiling starts from
STEPSCOPE_URL / STEPSCOPE_JOB_ID); without it this script never imports stepscope, as a job
under `stepscope run` (zero-code) does not. Each rank writes DIR/rank<r>.json: what it trained,
and the forward delay it added.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never online

import torch
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

SEQ_LEN = 32
PAD_LEN = 4
"""Padding at the end of each sequence (attention mask 0, label -100)."""
PACE_STEPS = range(5, 20)
"""Steps whose median wall time the slowed rank measures before its delay starts."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="directory for rank<r>.json")
    p.add_argument("--callback", action="store_true", help="pass StepscopeCallback() by hand")
    p.add_argument("--steps", type=int, default=120, help="max_steps")
    p.add_argument("--batch-size", type=int, default=4, help="per_device_train_batch_size")
    p.add_argument("--slow-rank", type=int, default=2)
    p.add_argument("--slow-from-step", type=int, default=20)
    p.add_argument(
        "--slow-fraction",
        type=float,
        default=0.45,
        help="the slowed rank's forward delay, as a fraction of its median step before it",
    )
    return p.parse_args()


class RandomTokens(Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, each with PAD_LEN padding positions at its end."""

    def __init__(self, num_samples: int, vocab_size: int) -> None:
        self.num_samples = num_samples
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        input_ids = torch.randint(0, self.vocab_size, (SEQ_LEN,), generator=generator)
        attention_mask = torch.ones(SEQ_LEN, dtype=torch.long)
        attention_mask[SEQ_LEN - PAD_LEN :] = 0
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class ForwardDelay(TrainerCallback):
    """On the slowed rank: measures its median step, then sleeps a fixed fraction of it at the
    start of every training forward from `from_step` on."""

    def __init__(self, *, slowed: bool, from_step: int, fraction: float) -> None:
        self.slowed = slowed
        self.from_step = from_step
        self.fraction = fraction
        self.delay_s = 0.0
        self._step_s: list[float] = []
        self._started = 0.0

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._started = time.perf_counter()
        if self.slowed and state.global_step == self.from_step:
            self.delay_s = self.fraction * statistics.median(self._step_s)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.global_step - 1 in PACE_STEPS:
            self._step_s.append(time.perf_counter() - self._started)

    def pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.delay_s and module.training:
            time.sleep(self.delay_s)


def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    model = build_model()
    delay = ForwardDelay(
        slowed=rank == args.slow_rank, from_step=args.slow_from_step, fraction=args.slow_fraction
    )
    model.register_forward_pre_hook(delay.pre_forward)
    callbacks: list[TrainerCallback] = [delay]
    if args.callback:
        from stepscope.integrations.transformers import StepscopeCallback

        callbacks.append(StepscopeCallback())
    training_args = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        use_cpu=True,
        ddp_backend="gloo",
        report_to="none",
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        learning_rate=1e-3,
        seed=0,
        ddp_find_unused_parameters=False,
    )
    dataset = RandomTokens(args.steps * args.batch_size * world_size, model.config.vocab_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=callbacks)
    start = time.perf_counter()
    output = trainer.train()
    summary = {
        "rank": rank,
        "global_step": output.global_step,
        "train_s": time.perf_counter() - start,
        "delay_s": delay.delay_s,
        "ddp": type(trainer.model_wrapped).__name__,
        "samples_per_step": args.batch_size,
        "tokens_per_step": args.batch_size * (SEQ_LEN - PAD_LEN),
        "input_tokens_per_step": args.batch_size * SEQ_LEN,
        "num_params_without_embeddings": model.num_parameters(exclude_embeddings=True),
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
