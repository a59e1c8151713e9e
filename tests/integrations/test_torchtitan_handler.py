"""torchtitan's real structured logger, fed on CPU as its Trainer feeds it, drives the profiler
through stepscope's handler; torchtitan's own JSONL output is still written."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torchtitan.observability.structured_logger as sl  # `make venv` installs it --no-deps
from torchtitan.observability.structured_logger import structured_logging

from stepscope.integrations.torchtitan import HANDLER_FACTORIES
from stepscope.profiler import session
from stepscope.profiler.auto import passive
from tests.live_server import RunningServer, read_rows, run_server

FETCH_S = 0.01
FWD_BWD_S = 0.01
OPTIM_S = 0.01
EVAL_S = 0.01
GRAD_ACCUM_STEPS = 2
LOCAL_VALID_TOKENS = 4096


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server() as running:
        yield running


@dataclass(frozen=True, slots=True)
class TitanRank:
    """A rank whose torchtitan structured logger has stepscope's handler."""

    logger: logging.Logger
    job_id: str
    output_dir: Path

    def exit(self) -> None:
        """Close the logger's handlers, as logging.shutdown() does when the process exits."""
        for handler in self.logger.handlers:
            handler.close()
        assert session.current() is None  # stepscope's profiler closed with its handler


@pytest.fixture
def titan(
    server: RunningServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[TitanRank]:
    """torchtitan's structured logger, initialised in this process as its train.py does, with
    TITAN_STRUCT_LOGGER_HANDLERS set as stepscope's launcher sets it."""
    job_id = request.node.name
    monkeypatch.setenv("TITAN_STRUCT_LOGGER_HANDLERS", HANDLER_FACTORIES)
    monkeypatch.setenv("STEPSCOPE_URL", server.url)
    monkeypatch.setenv("STEPSCOPE_JOB_ID", job_id)
    monkeypatch.setenv("STEPSCOPE_FLUSH_INTERVAL_S", "0.2")
    monkeypatch.setattr(structured_logging, "_is_initialized", False)  # once a process
    logger: logging.Logger = structured_logging._structured_logger
    handlers_before = list(logger.handlers)
    sl.init_structured_logger(source="training", output_dir=str(tmp_path), rank=0)
    yield TitanRank(logger=logger, job_id=job_id, output_dir=tmp_path)
    for handler in logger.handlers[len(handlers_before) :]:
        logger.removeHandler(handler)
        handler.close()
    passive.uninstall()  # claim_profiler() patched DDP, pipeline stages and dcp


@sl.log_trace_span("fwd_bwd")
def forward_backward_step() -> None:
    time.sleep(FWD_BWD_S)


@sl.log_trace_span("eval")
def validate() -> None:
    time.sleep(EVAL_S)


def train_step(*, fail: bool = False) -> None:
    """torchtitan's Trainer.train_step, as its structured logger sees it."""
    for _ in range(GRAD_ACCUM_STEPS):
        with sl.log_trace_span("fetching_batch"):
            time.sleep(FETCH_S)
    sl.log_trace_scalar({"local_valid_tokens": LOCAL_VALID_TOKENS})
    for _ in range(GRAD_ACCUM_STEPS):
        forward_backward_step()
    if fail:
        raise RuntimeError("injected in train_step")
    with sl.log_trace_span("optim"):
        time.sleep(OPTIM_S)
    with sl.log_trace_span("collect_dist_metrics"):
        sl.log_trace_scalar({"global_valid_tokens": 2 * LOCAL_VALID_TOKENS})


def train(
    *, loaded_step: int, num_steps: int, eval_step: int | None = None, fail_step: int | None = None
) -> None:
    """torchtitan's Trainer.train from `loaded_step` (a checkpoint's step, 0 when fresh)."""
    sl.log_trace_instant("training_start")
    for step in range(loaded_step + 1, num_steps + 1):
        sl.set_step(step, relative_step=step - loaded_step)
        with sl.log_trace_span("step"):
            train_step(fail=step == fail_step)
            if step == eval_step:
                validate()


def test_torchtitan_spans_become_steps_sections_data_waits_and_tokens(
    titan: TitanRank, server: RunningServer
) -> None:
    running = session.current()
    assert running is not None
    assert running.owner == "torchtitan"
    train(loaded_step=10, num_steps=13, eval_step=12)  # resumed from a step-10 checkpoint
    titan.exit()

    rows = sorted(read_rows(server.db_url, "steps", titan.job_id), key=lambda r: r["step"])
    assert [r["step"] for r in rows] == [11, 12, 13]
    for row in rows:
        assert row["step_rule"] == "torchtitan"
        assert row["tokens"] == LOCAL_VALID_TOKENS
        assert row["data_s"] >= GRAD_ACCUM_STEPS * FETCH_S
        assert row["optimizer_s"] >= OPTIM_S
        assert row["forward_s"] is None  # fwd_bwd is not split
        assert row["backward_s"] is None
        assert row["step_s"] >= row["data_s"] + row["optimizer_s"] + GRAD_ACCUM_STEPS * FWD_BWD_S
    events = read_rows(server.db_url, "events", titan.job_id)
    records = [e["attributes"] for e in events if e["message"] == "record"]
    fwd_bwd = {r["step"]: r["fwd_bwd_s"] for r in records}
    assert sorted(fwd_bwd) == [11, 12, 13]
    assert all(s >= GRAD_ACCUM_STEPS * FWD_BWD_S for s in fwd_bwd.values())
    [phase] = [e["attributes"] for e in events if e["kind"] == "phase"]
    assert phase["name"] == "eval"
    assert phase["duration_s"] >= EVAL_S
    [resume] = [e["attributes"] for e in events if e["kind"] == "resume"]
    assert (resume["step"], resume["resumed_from"]) == (11, 11)
    [exit_event] = [e["attributes"] for e in events if e["kind"] == "exit"]
    assert exit_event["failed"] == 0

    [jsonl] = (titan.output_dir / "structured_logs").glob("training.global_rank_0.*.jsonl")
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in lines if r["log_type_name"] == "step_end"] == [11, 12, 13]
    assert {"fetching_batch_end", "fwd_bwd_end", "optim_end", "metric_value"} <= {
        r["log_type_name"] for r in lines
    }


def test_a_step_that_raises_fails_the_step_and_the_job(
    titan: TitanRank, server: RunningServer
) -> None:
    with pytest.raises(RuntimeError, match="injected"):
        train(loaded_step=0, num_steps=3, fail_step=2)
    titan.exit()  # the exception ends the process

    rows = sorted(read_rows(server.db_url, "steps", titan.job_id), key=lambda r: r["step"])
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["optimizer_s"] is None  # it raised before the optimizer
    events = read_rows(server.db_url, "events", titan.job_id)
    [exception] = [e for e in events if e["kind"] == "exception"]
    assert exception["message"] == "StepFailed: RuntimeError: injected in train_step"
    assert exception["attributes"]["step"] == 2
    [exit_event] = [e["attributes"] for e in events if e["kind"] == "exit"]
    assert exit_event["failed"] == 1
    [resume] = [e["attributes"] for e in events if e["kind"] == "resume"]
    assert (resume["step"], resume["resumed_from"]) == (1, None)
    [job] = read_rows(server.db_url, "jobs", titan.job_id)
    assert job["status"] == "failed"


def test_a_handler_error_never_reaches_training_and_is_logged_once(
    titan: TitanRank,
    server: RunningServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    running = session.current()
    assert running is not None

    def broken(name: str) -> None:
        raise RuntimeError("injected profiler bug")

    monkeypatch.setattr(running.profiler, "end_section", broken)
    train(loaded_step=0, num_steps=3)  # raises nothing
    titan.exit()

    warnings = [r for r in caplog.records if r.name == "stepscope.integrations.torchtitan"]
    assert [r.getMessage() for r in warnings] == [
        "stepscope: torchtitan's records are no longer handled"
    ]
    # The handler stopped at step 1's first fwd_bwd end; the profiler closed that step at exit.
    rows = read_rows(server.db_url, "steps", titan.job_id)
    assert [r["step"] for r in rows] == [1]
