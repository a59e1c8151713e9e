"""Reading the demo job's progress from torchrun's shared output, and its plan."""

from __future__ import annotations

import pytest

from stepscope.demo.job import Progress, TrainPlan, parse_line


def test_progress_is_read_even_when_another_rank_writes_into_the_line() -> None:
    assert parse_line("stepscope-demo: step 76USDT:2026-12-04 20:22:56 profiler") == Progress(
        kind="step", step=76
    )
    assert parse_line("stepscope-demo: checkpoint saved at step 40") == Progress(
        kind="checkpoint", step=40
    )
    assert parse_line("stepscope-demo: restart 1: resumed from the checkpoint of step 80") == (
        Progress(kind="restart", step=80)
    )
    assert parse_line("[rank3]: RuntimeError: injected failure on rank 3 at step 90") == (
        Progress(kind="crash", rank=3, step=90)
    )
    assert parse_line("stepscope-demo: step") is None
    assert parse_line("W1204 torch/distributed/elastic: Sending process closing signal") is None


def test_the_restart_resumes_from_the_last_checkpoint_before_the_crash() -> None:
    assert TrainPlan().resume_step == 80
    assert TrainPlan(ckpt_every=25, crash_step=90).resume_step == 75
    with pytest.raises(ValueError, match="after the first checkpoint"):
        TrainPlan(ckpt_every=40, crash_step=30)
