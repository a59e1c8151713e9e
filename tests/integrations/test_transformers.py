"""The Hugging Face Trainer adapter in this process: a tiny Llama trained by a real Trainer
(one CPU rank), profiled into a real collector through `StepscopeCallback`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import transformers.trainer
from transformers import Trainer, TrainingArguments

from stepscope.integrations import transformers as adapter
from stepscope.integrations.transformers import StepscopeCallback, attach
from stepscope.profiler import session
from stepscope.profiler.auto import passive
from tests.integrations.hf_train import PAD_LEN, SEQ_LEN, RandomTokens, build_model
from tests.live_server import RunningServer, read_rows, run_server

FETCH_S = 0.02
"""Each training sample takes this long to load."""
BATCH_SIZE = 2
ACCUMULATION_STEPS = 2
NUM_STEPS = 3
EVERY_STEPS = 2
"""Evaluate and save a checkpoint every this many steps."""


class SlowTokens(RandomTokens):
    """RandomTokens that take FETCH_S to load each."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(FETCH_S)
        return super().__getitem__(index)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server() as running:
        yield running


@pytest.fixture(autouse=True)
def no_adapter_left() -> Iterator[None]:
    """Nothing of the adapter is left after a test: the Trainer unpatched, no profiler."""
    yield
    adapter.unpatch_trainer()
    passive.uninstall()
    running = session.current()
    if running is not None:  # the test failed before the adapter closed its profiler
        running.profiler.close()


@pytest.fixture
def job_id(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> str:
    """This test's job, profiled into the server (as STEPSCOPE_URL and _JOB_ID say)."""
    monkeypatch.setenv("STEPSCOPE_URL", server.url)
    monkeypatch.setenv("STEPSCOPE_JOB_ID", request.node.name)
    return str(request.node.name)


def trainer_of(out: Path, *, callbacks: list[Any], **options: Any) -> Trainer:
    """A Trainer of the tiny Llama on slow samples: NUM_STEPS updates of ACCUMULATION_STEPS
    micro-batches, evaluated and saved every EVERY_STEPS."""
    model = build_model()
    args = TrainingArguments(
        **{
            "output_dir": str(out),
            "use_cpu": True,
            "report_to": "none",
            "per_device_train_batch_size": BATCH_SIZE,
            "per_device_eval_batch_size": BATCH_SIZE,
            "gradient_accumulation_steps": ACCUMULATION_STEPS,
            "max_steps": NUM_STEPS,
            "logging_strategy": "no",
            "eval_strategy": "steps",
            "eval_steps": EVERY_STEPS,
            "save_strategy": "steps",
            "save_steps": EVERY_STEPS,
            "dataloader_num_workers": 0,
            "disable_tqdm": True,
            **options,
        }
    )
    vocab_size = model.config.vocab_size
    return Trainer(
        model=model,
        args=args,
        train_dataset=SlowTokens(NUM_STEPS * BATCH_SIZE * ACCUMULATION_STEPS, vocab_size),
        eval_dataset=RandomTokens(BATCH_SIZE, vocab_size),
        callbacks=callbacks,
    )


def stored_steps(server: RunningServer, job_id: str) -> list[dict[str, Any]]:
    return sorted(read_rows(server.db_url, "steps", job_id), key=lambda r: r["step"])


def test_a_step_is_an_optimizer_update_with_its_micro_batches_work_and_sections(
    server: RunningServer, job_id: str, tmp_path: Path
) -> None:
    trainer = trainer_of(tmp_path, callbacks=[StepscopeCallback()])
    trainer.train()

    assert session.current() is None  # the callback started the profiler, and closed it
    rows = stored_steps(server, job_id)
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))
    micro_batches = BATCH_SIZE * ACCUMULATION_STEPS
    flops = 6 * micro_batches * SEQ_LEN * trainer.model.num_parameters(exclude_embeddings=True)
    for row in rows:
        assert row["step_rule"] == "transformers"
        assert row["samples"] == micro_batches
        assert row["tokens"] == micro_batches * (SEQ_LEN - PAD_LEN)  # the padding is not counted
        assert row["flops"] == flops
        assert row["data_s"] >= BATCH_SIZE * FETCH_S  # a step waits for a batch at least
        assert min(row["forward_s"], row["backward_s"], row["optimizer_s"]) > 0
        sections_s = row["forward_s"] + row["backward_s"] + row["optimizer_s"]
        assert row["step_s"] >= row["data_s"] + sections_s - 1e-6
    # Every sample was loaded in the data wait of a step: the Trainer fetches a step's
    # micro-batches before on_step_begin (and accelerate loads each batch one ahead).
    assert sum(r["data_s"] for r in rows) >= NUM_STEPS * micro_batches * FETCH_S


def test_evaluation_and_checkpoint_saves_are_phases_between_steps(
    server: RunningServer, job_id: str, tmp_path: Path
) -> None:
    trainer_of(tmp_path, callbacks=[StepscopeCallback()]).train()

    rows = stored_steps(server, job_id)
    phases = [e for e in read_rows(server.db_url, "events", job_id) if e["kind"] == "phase"]
    # After step EVERY_STEPS - 1, and after the last step.
    assert sorted(p["attributes"]["name"] for p in phases) == 2 * ["checkpoint_save"] + 2 * ["eval"]
    for phase in phases:
        start, end = phase["ts"], phase["ts"] + phase["attributes"]["duration_s"]
        assert all(end <= r["ts"] or start >= r["ts"] + r["step_s"] for r in rows), phase


def test_a_resumed_run_numbers_its_steps_from_the_checkpoint(
    server: RunningServer, job_id: str, tmp_path: Path
) -> None:
    trainer_of(tmp_path, callbacks=[StepscopeCallback()], max_steps=EVERY_STEPS).train()
    resumed = trainer_of(tmp_path, callbacks=[StepscopeCallback()])
    resumed.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{EVERY_STEPS}"))

    starts = [e for e in read_rows(server.db_url, "events", job_id) if e["kind"] == "resume"]
    firsts = sorted((e["attributes"]["step"], e["attributes"]["resumed_from"]) for e in starts)
    assert firsts == [(0, None), (EVERY_STEPS, EVERY_STEPS)]
    steps = sorted(r["step"] for r in read_rows(server.db_url, "steps", job_id))
    assert steps == [*range(EVERY_STEPS), *range(EVERY_STEPS, NUM_STEPS)]


def test_a_train_that_raises_ends_its_step_as_failed_and_closes_the_profiler(
    server: RunningServer, job_id: str, tmp_path: Path
) -> None:
    trainer = trainer_of(tmp_path, callbacks=[StepscopeCallback()], eval_strategy="no")

    def fail_in_step_1(module: torch.nn.Module, args: Any) -> None:
        if module.training and trainer.state.global_step == 1:
            raise RuntimeError("injected training failure")

    trainer.model.register_forward_pre_hook(fail_in_step_1)
    with pytest.raises(RuntimeError, match="injected training failure"):
        trainer.train()

    assert session.current() is None
    assert [r["step"] for r in stored_steps(server, job_id)] == [0, 1]
    failures = [e for e in read_rows(server.db_url, "events", job_id) if e["kind"] == "exception"]
    assert [(e["message"], e["attributes"]["step"]) for e in failures] == [
        ("RuntimeError: injected training failure", 1)
    ]
    [job] = read_rows(server.db_url, "jobs", job_id)
    assert job["status"] == "failed"


def test_a_callback_given_by_hand_and_by_stepscope_run_counts_each_step_once(
    server: RunningServer, job_id: str, tmp_path: Path
) -> None:
    attach(transformers.trainer)
    try:
        trainer = trainer_of(tmp_path, callbacks=[StepscopeCallback()], eval_strategy="no")
        kinds = [type(c) for c in trainer.callback_handler.callbacks]
        assert kinds.count(StepscopeCallback) == 2
        trainer.train()
    finally:
        transformers.trainer.DEFAULT_CALLBACKS.remove(StepscopeCallback)

    assert [r["step"] for r in stored_steps(server, job_id)] == list(range(NUM_STEPS))


def test_attach_is_idempotent_and_a_failure_to_attach_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    defaults = list(transformers.trainer.DEFAULT_CALLBACKS)
    attach(transformers.trainer)
    wrapped = Trainer.get_batch_samples
    try:
        attach(transformers.trainer)
        assert transformers.trainer.DEFAULT_CALLBACKS == [*defaults, StepscopeCallback]
        assert Trainer.get_batch_samples is wrapped
    finally:
        transformers.trainer.DEFAULT_CALLBACKS.remove(StepscopeCallback)

    caplog.set_level(logging.DEBUG, logger=adapter.__name__)
    attach(ModuleType("transformers.trainer"))  # no DEFAULT_CALLBACKS, no Trainer
    assert [r.exc_info is not None for r in caplog.records] == [True]
    assert "could not attach to the Hugging Face Trainer" in caplog.messages[0]
