"""The public training API in one process: no-op when disabled, records when enabled, fail-open."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch._C._distributed_c10d import ProcessGroup

import stepscope
from stepscope.profiler.base import NULL_CONTEXT, Profiler
from stepscope.profiler.loop import finished
from stepscope.profiler.loop.steps import StepRecord
from tests.live_server import RunningServer, read_rows


def test_importing_stepscope_pulls_in_nothing_server_side_nor_torch() -> None:
    code = (
        "import sys, stepscope, stepscope.profiler; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi','sqlalchemy','dash','polars','plotly','torch') or m.startswith("
        "('stepscope.collector','stepscope.store','stepscope.api','stepscope.dashboard',"
        "'stepscope.analysis')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("env", [{}, {"STEPSCOPE_DISABLED": "1", "STEPSCOPE_URL": "http://x:1"}])
def test_disabled_profiler_is_a_cheap_no_op(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    monkeypatch.delenv("STEPSCOPE_URL", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    threads_before = threading.active_count()
    allreduce = ProcessGroup.__dict__["allreduce"]
    prof = stepscope.init(job_id="off")
    assert type(prof) is Profiler
    assert not prof.enabled
    loader = [1, 2, 3]
    assert prof.wrap_dataloader(loader) is loader
    assert prof.step() is NULL_CONTEXT
    assert ProcessGroup.__dict__["allreduce"] is allreduce
    assert threading.active_count() == threads_before
    # Cheap, counted rather than timed (a loaded machine cannot fail it): a step with a
    # section and a record is a handful of calls, none into stepscope beyond the methods.
    called: list[str] = []

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            called.append(frame.f_code.co_qualname if event == "call" else repr(arg))

    sys.setprofile(count)
    try:
        with prof.step(), prof.section("forward"):
            pass
        prof.record(tokens=1)
    finally:
        sys.setprofile(None)
    assert len(called) <= 8, called
    prof.close()


def test_a_section_entered_inside_itself_times_both_spans_every_step(
    live_server: RunningServer,
) -> None:
    # A section entered inside one of the same name: both spans count, every step.
    prof = stepscope.init(job_id="sections-1", url=live_server.url, flush_interval_s=0.2)
    for _ in range(3):
        with prof.step():
            with prof.section("forward"):
                time.sleep(0.01)
                with prof.section("forward"):
                    time.sleep(0.02)
            with prof.section("forward"):
                time.sleep(0.005)
    prof.close()
    rows = read_rows(live_server.db_url, "steps", "sections-1")
    assert len(rows) == 3
    for row in rows:  # outer (>= 0.03) + inner (>= 0.02) + the third (>= 0.005)
        assert row["forward_s"] >= 0.055


def test_a_section_timed_on_another_thread_meanwhile_keeps_its_own_span(
    live_server: RunningServer,
) -> None:
    # The main thread's "forward" is made, then a loader thread times its own "forward" across
    # the main thread's entry: each must keep its span.
    prof = stepscope.init(job_id="sections-2", url=live_server.url, flush_interval_s=0.2)
    other_entered, main_entered = threading.Event(), threading.Event()

    def other_thread() -> None:
        with prof.section("forward"):
            other_entered.set()
            main_entered.wait(5)
            time.sleep(0.02)

    with prof.step():
        section = prof.section("forward")
        thread = threading.Thread(target=other_thread)
        thread.start()
        other_entered.wait(5)
        with section:
            main_entered.set()
            time.sleep(0.03)
            thread.join(5)
    prof.close()
    [row] = read_rows(live_server.db_url, "steps", "sections-2")
    assert row["forward_s"] >= 0.05  # the main thread's >= 0.03 and the other's >= 0.02


class Linear(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.layer = nn.Linear(width_in, width_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def slow_loader(num_batches: int, delay_s: float, batch: int, width: int) -> Iterator[torch.Tensor]:
    for _ in range(num_batches):
        time.sleep(delay_s)
        yield torch.randn(batch, width)


def test_single_process_run_records_steps_sections_data_flops_and_events(
    live_server: RunningServer,
) -> None:
    batch, width_in, width_out, delay_s = 8, 32, 16, 0.02
    model = Linear(width_in, width_out)
    original_allreduce = ProcessGroup.__dict__["allreduce"]
    prof = stepscope.init(
        job_id="single-1",
        url=live_server.url,
        model=model,
        flops_per_step="auto",
        samples_per_step=batch,
        flush_interval_s=0.2,
    )
    assert prof.enabled
    assert ProcessGroup.__dict__["allreduce"] is not original_allreduce  # the tap is in
    for x in prof.wrap_dataloader(slow_loader(5, delay_s, batch, width_in)):
        with prof.step():
            with prof.section("forward"):
                loss = model(x).square().mean()
            with prof.section("backward"):
                loss.backward()
            with prof.section("clip"):
                time.sleep(0.005)
            prof.record(tokens=100, loss=loss.item())
    prof.event("custom", "checkpoint saved", path="/tmp/ckpt")
    prof.close()
    assert ProcessGroup.__dict__["allreduce"] is original_allreduce

    rows = sorted(read_rows(live_server.db_url, "steps", "single-1"), key=lambda r: r["step"])
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for r in rows:
        assert r["data_s"] >= delay_s
        assert r["step_s"] >= r["data_s"] + r["forward_s"] + r["backward_s"]
        assert r["forward_s"] > 0
        assert r["backward_s"] > 0
        assert r["tokens"] == 100
        assert r["samples"] == batch
        # forward x@W.T and backward dW only (the input needs no gradient): 2 + 2 FLOPs per MAC
        assert r["flops"] == 4 * batch * width_in * width_out
        assert r["comm_s"] is None
    events = read_rows(live_server.db_url, "events", "single-1")
    messages = [e["message"] for e in events]
    assert "checkpoint saved" in messages
    assert any("peak FLOP/s unknown for device 'cpu'" in m for m in messages)
    records = [e for e in events if e["message"] == "record"]
    assert len(records) == 5
    assert all(e["attributes"]["clip_s"] >= 0.005 for e in records)
    [job] = read_rows(live_server.db_url, "jobs", "single-1")
    assert job["device_name"] == "cpu"
    assert job["peak_flops"] is None


def test_a_profiler_bug_never_reaches_the_training_loop(
    live_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: StepRecord, clock: object, mesh_dims: object) -> object:
        raise RuntimeError("injected profiler bug")

    monkeypatch.setattr(StepRecord, "to_rows", broken)
    model = Linear(4, 2)
    prof = stepscope.init(job_id="broken-1", url=live_server.url, flush_interval_s=0.2)
    # The shipper thread turns finished steps into rows (every 0.2 s here); the step that
    # ends after its failure turns profiling off.
    completed = 0
    deadline = time.monotonic() + 30.0
    while prof.step() is not NULL_CONTEXT and time.monotonic() < deadline:
        with prof.step():
            with prof.section("forward"):
                loss = model(torch.randn(2, 4)).sum()
            loss.backward()
        completed += 1
        time.sleep(0.02)
    assert prof.step() is NULL_CONTEXT
    assert completed >= 1
    prof.close()
    events = read_rows(live_server.db_url, "events", "broken-1")
    [event] = [e for e in events if e["kind"] == "exception"]
    assert "injected profiler bug" in event["message"]


def _rows_built_by_thread(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread of each StepRecord.to_rows call from now on."""
    threads: list[str] = []
    to_rows = StepRecord.to_rows

    def recorded(self: StepRecord, clock: Any, mesh_dims: dict[str, str]) -> Any:
        threads.append(threading.current_thread().name)
        return to_rows(self, clock, mesh_dims)

    monkeypatch.setattr(StepRecord, "to_rows", recorded)
    return threads


def test_the_shipper_thread_turns_finished_steps_into_rows(
    live_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = _rows_built_by_thread(monkeypatch)
    prof = stepscope.init(job_id="rows-1", url=live_server.url, flush_interval_s=0.1)
    for _ in range(40):
        with prof.step():
            with prof.section("forward"):
                time.sleep(0.001)
    deadline = time.monotonic() + 30.0
    while len(prof._finished) and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    assert threads == ["stepscope-shipper"] * 40
    prof.close()
    rows = read_rows(live_server.db_url, "steps", "rows-1")
    assert sorted(row["step"] for row in rows) == list(range(40))
    assert all(row["forward_s"] >= 0.001 for row in rows)


def test_steps_the_shipper_thread_does_not_take_are_turned_into_rows_by_the_training_thread(
    live_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = _rows_built_by_thread(monkeypatch)
    monkeypatch.setattr(finished, "MAX_HELD_STEPS", 8)
    monkeypatch.setattr(finished.FinishedSteps, "ship_ready", lambda self: None)  # stuck
    prof = stepscope.init(job_id="rows-2", url=live_server.url, flush_interval_s=0.1)
    for _ in range(20):
        with prof.step():
            pass
        assert len(prof._finished) <= 9  # type: ignore[attr-defined]
    # Past 8 held steps, the step's end turns every held step into rows (on the CPU clock
    # every mark has happened): at the 9th and the 18th.
    assert set(threads) == {"MainThread"}
    assert len(threads) == 20 - len(prof._finished)  # type: ignore[attr-defined]
    prof.close()
    rows = read_rows(live_server.db_url, "steps", "rows-2")
    assert sorted(row["step"] for row in rows) == list(range(20))


class _ModelOnGpu3:
    """What the profiler reads of a model on cuda:3 (no GPU here)."""

    def parameters(self) -> Iterator[Any]:
        yield types.SimpleNamespace(device=torch.device("cuda", 3))


@pytest.mark.parametrize(("current", "warned"), [(0, True), (3, False)])
def test_a_model_off_the_current_cuda_device_is_reported(
    live_server: RunningServer, monkeypatch: pytest.MonkeyPatch, current: int, warned: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    job_id = f"off-device-{current}"
    prof = stepscope.init(job_id=job_id, url=live_server.url, model=_ModelOnGpu3())
    prof.close()
    messages = [e["message"] for e in read_rows(live_server.db_url, "events", job_id)]
    assert not [m for m in messages if m.startswith("stepscope internal error")]
    off_device = [m for m in messages if "current CUDA device" in m]
    if warned:
        assert off_device == [
            "the model is on cuda:3 but the current CUDA device is cuda:0: stepscope's CUDA "
            "events go on the current device's stream and do not time the model. Call "
            "torch.cuda.set_device(3) before stepscope.init()."
        ]
    else:
        assert off_device == []


def test_user_exceptions_pass_through_the_context_managers(live_server: RunningServer) -> None:
    with pytest.raises(ZeroDivisionError):  # noqa: PT012 (the with-blocks are the subject)
        with stepscope.init(job_id="raises-1", url=live_server.url) as prof, prof.step():
            _ = 1 / 0
    events = read_rows(live_server.db_url, "events", "raises-1")
    assert [e["kind"] for e in events if e["kind"] == "exception"] == ["exception"]
    [row] = read_rows(live_server.db_url, "steps", "raises-1")
    assert row["step"] == 0
