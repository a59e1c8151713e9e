"""Zero-code's step rule in one process: the steps a loop that never calls stepscope stores.

Zero-code is installed as `stepscope run` installs it (`hooks.install()`), the profiler it
starts ships to a real collector, and `hooks.uninstall()` closes it before the rows are read.
"""

from __future__ import annotations

import copy
import io
import math
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import SGD, Adam, Optimizer
from torch.utils.data import DataLoader, TensorDataset, default_collate

import stepscope
from stepscope.profiler.auto import hooks
from tests.live_server import RunningServer, read_rows, run_server

BATCH = 4
DATA_DELAY_S = 0.02
"""How long each training batch takes to load (its collate sleeps)."""


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """One collector for the file's tests; each test has a job of its own."""
    with run_server() as running:
        yield running


@dataclass(slots=True)
class Job:
    """A job that zero-code profiles in this process, and what the collector stored of it."""

    job_id: str
    db_url: str

    def steps(self) -> list[dict[str, Any]]:
        """The stored steps, in order, once zero-code closed its profiler."""
        hooks.uninstall()
        return sorted(read_rows(self.db_url, "steps", self.job_id), key=lambda r: r["step"])

    def phases(self) -> list[str]:
        """The names of the stored phase events (read after steps())."""
        events = read_rows(self.db_url, "events", self.job_id)
        return [e["attributes"]["name"] for e in events if e["kind"] == "phase"]


@pytest.fixture
def job(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    """This process's profiler settings, as `stepscope run` gives them; zero-code is
    uninstalled afterwards whatever the test did."""
    job_id = f"zero-code-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("STEPSCOPE_URL", server.url)
    monkeypatch.setenv("STEPSCOPE_JOB_ID", job_id)
    monkeypatch.setenv("STEPSCOPE_FLUSH_INTERVAL_S", "0.2")
    try:
        yield Job(job_id=job_id, db_url=server.db_url)
    finally:
        hooks.uninstall()


@pytest.fixture
def zero_code(job: Job) -> Job:
    """The job, with zero-code installed (as the bootstrap does before the script runs)."""
    hooks.install()
    return job


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def build_loader(num_batches: int, *, delay_s: float = DATA_DELAY_S) -> DataLoader[Any]:
    """Batches of BATCH samples, each taking `delay_s` to load."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(num_batches * BATCH, 8, generator=generator)
    y = torch.randn(num_batches * BATCH, 1, generator=generator)

    def slow_collate(samples: list[Any]) -> Any:
        time.sleep(delay_s)
        return default_collate(samples)

    return DataLoader(TensorDataset(x, y), batch_size=BATCH, collate_fn=slow_collate)


def loss_of(
    model: Callable[[torch.Tensor], torch.Tensor], batch: list[torch.Tensor]
) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def assert_training_steps(rows: list[dict[str, Any]], num_steps: int, samples: int) -> None:
    """`num_steps` steps of the optimizer rule, each with its sections, data wait and samples."""
    assert [r["step"] for r in rows] == list(range(num_steps))
    for row in rows:
        assert row["step_rule"] == "optimizer", row
        assert row["samples"] == samples, row
        assert row["data_s"] >= DATA_DELAY_S, row
        for section in ("forward_s", "backward_s", "optimizer_s"):
            assert (row[section] or 0.0) > 0, (section, row)


def test_a_plain_loop_stores_one_step_per_update(zero_code: Job) -> None:
    num_steps = 5
    model = build_model()
    optimizer = SGD(model.parameters(), lr=0.01)
    for batch in build_loader(num_steps):
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
    assert_training_steps(zero_code.steps(), num_steps, samples=BATCH)


def test_torchdatas_stateful_data_loader_waits_are_data_wait(zero_code: Job) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    num_steps = 5
    model = build_model()
    optimizer = SGD(model.parameters(), lr=0.01)
    plain = build_loader(num_steps)
    loader = StatefulDataLoader(plain.dataset, batch_size=BATCH, collate_fn=plain.collate_fn)
    for batch in loader:
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
    assert_training_steps(zero_code.steps(), num_steps, samples=BATCH)


def test_gradient_accumulation_makes_one_step_per_update(zero_code: Job) -> None:
    num_updates, accumulate = 3, 4
    model = build_model()
    optimizer = SGD(model.parameters(), lr=0.01)
    for i, batch in enumerate(build_loader(num_updates * accumulate)):
        (loss_of(model, batch) / accumulate).backward()
        if (i + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    assert_training_steps(zero_code.steps(), num_updates, samples=accumulate * BATCH)


def test_two_optimizers_stepped_each_iteration_make_one_step(zero_code: Job) -> None:
    num_steps = 4
    model = build_model()
    first, second = model[0], model[2]
    optimizers = [SGD(first.parameters(), lr=0.01), Adam(second.parameters(), lr=0.01)]
    for batch in build_loader(num_steps):
        loss_of(model, batch).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert_training_steps(zero_code.steps(), num_steps, samples=BATCH)


class OptimizersContainer(Optimizer):
    """torchtitan's pattern: an Optimizer (for the hooks and schedulers that expect one) that
    steps one inner optimizer per model part."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.optimizers = [SGD(part.parameters(), lr=0.01) for part in parts]
        params = [p for part in parts for p in part.parameters()]
        Optimizer.__init__(self, params, {"lr": 0.01})

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)


def test_an_optimizer_container_makes_one_step_per_iteration(zero_code: Job) -> None:
    num_steps = 4
    model = build_model()
    optimizer = OptimizersContainer([model[0], model[2]])
    for batch in build_loader(num_steps):
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
    assert_training_steps(zero_code.steps(), num_steps, samples=BATCH)


def test_an_amp_step_the_scaler_skips_still_ends_its_step(zero_code: Job) -> None:
    num_steps, overflow_at = 5, 2
    model = build_model()
    optimizer = SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    skipped = []
    for i, batch in enumerate(build_loader(num_steps)):
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        if i == overflow_at:
            loss = loss * math.inf  # inf gradients: the scaler skips this update
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        after = list(model.parameters())
        skipped.append(all(torch.equal(b, a) for b, a in zip(before, after, strict=True)))
    assert skipped == [i == overflow_at for i in range(num_steps)]
    rows = zero_code.steps()
    assert [r["step"] for r in rows] == list(range(num_steps))
    assert all(r["step_rule"] == "optimizer" and r["samples"] == BATCH for r in rows)


def test_an_eval_loop_between_steps_is_an_eval_phase_not_steps(zero_code: Job) -> None:
    steps_before, steps_after, eval_batches, eval_delay_s = 3, 3, 3, 0.2
    model = build_model()
    optimizer = SGD(model.parameters(), lr=0.01)
    train = iter(build_loader(steps_before + steps_after))

    def train_steps(num_steps: int) -> None:
        for _ in range(num_steps):
            batch = next(train)
            optimizer.zero_grad()
            loss_of(model, batch).backward()
            optimizer.step()

    train_steps(steps_before)
    model.eval()
    with torch.no_grad():
        for batch in build_loader(eval_batches, delay_s=eval_delay_s):
            loss_of(model, batch)
    model.train()
    train_steps(steps_after)

    rows = zero_code.steps()
    assert_training_steps(rows, steps_before + steps_after, samples=BATCH)
    assert zero_code.phases() == ["eval"]
    # Evaluation's input waits (>= 0.6 s in all) are not the next training step's.
    assert rows[steps_before]["data_s"] < eval_batches * eval_delay_s


def test_a_teachers_no_grad_forward_in_each_step_is_part_of_the_step(zero_code: Job) -> None:
    num_steps = 5
    student, teacher = build_model(), build_model().eval()
    optimizer = SGD(student.parameters(), lr=0.01)
    for batch in build_loader(num_steps):
        with torch.no_grad():
            loss_of(teacher, batch)  # a distillation teacher: no grad, eval mode, every step
        optimizer.zero_grad()
        loss_of(student, batch).backward()
        optimizer.step()

    rows = zero_code.steps()
    assert_training_steps(rows, num_steps, samples=BATCH)  # each with its batch's data wait
    assert zero_code.phases() == []


def train_compiled(num_steps: int) -> int:
    """Train a freshly compiled model for `num_steps`; the graph breaks dynamo counted."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build_model()
    compiled = torch.compile(model, backend="eager")
    optimizer = SGD(model.parameters(), lr=0.01)
    for batch in build_loader(num_steps):
        optimizer.zero_grad()
        loss_of(compiled, batch).backward()
        optimizer.step()
    return sum(counters["graph_break"].values())


def test_a_compiled_model_is_stepped_without_a_graph_break_more(job: Job) -> None:
    num_steps = 5
    graph_breaks_unprofiled = train_compiled(num_steps)
    hooks.install()
    graph_breaks_profiled = train_compiled(num_steps)
    assert graph_breaks_profiled == graph_breaks_unprofiled
    assert_training_steps(job.steps(), num_steps, samples=BATCH)


def test_inference_without_an_optimizer_steps_per_batch(zero_code: Job) -> None:
    num_batches = 5
    model = build_model().eval()
    with torch.no_grad():
        for batch in build_loader(num_batches):
            loss_of(model, batch)
    rows = zero_code.steps()
    assert [r["step"] for r in rows] == list(range(num_batches))
    for row in rows:
        assert row["step_rule"] == "dataloader", row
        assert row["samples"] == BATCH, row
        assert row["data_s"] >= DATA_DELAY_S, row
        assert row["forward_s"] > 0, row
        assert (row["backward_s"], row["optimizer_s"]) == (None, None), row


@pytest.mark.parametrize("warmup_steps", [0, 2])
@pytest.mark.parametrize("init_first", [True, False])
def test_a_script_that_calls_init_itself_is_counted_once(
    zero_code: Job, init_first: bool, warmup_steps: int
) -> None:
    """init() before or after the optimizer is built, and after steps zero-code marked: the
    script's own step() blocks are stored once each, as the user's (no step_rule)."""
    num_steps = 4
    model = build_model()
    prof = stepscope.init() if init_first else None
    optimizer = SGD(model.parameters(), lr=0.01)
    batches = iter(build_loader(warmup_steps + num_steps))
    for _ in range(warmup_steps):
        optimizer.zero_grad()
        loss_of(model, next(batches)).backward()
        optimizer.step()
    prof = prof or stepscope.init()
    assert prof.enabled
    for batch in batches:
        with prof.step():
            optimizer.zero_grad()
            loss_of(model, batch).backward()
            optimizer.step()
    prof.close()
    rows = zero_code.steps()
    inferred = 0 if init_first else warmup_steps
    assert [r["step"] for r in rows] == list(range(inferred + num_steps))
    assert [r["step_rule"] for r in rows] == ["optimizer"] * inferred + [None] * num_steps


def hooked_modules(model: nn.Module) -> list[str]:
    """The names of the model's modules that carry forward hooks of their own."""
    return [
        name or "root"
        for name, module in model.named_modules()
        if module._forward_pre_hooks or module._forward_hooks
    ]


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_after_discovery_no_module_carries_hooks(zero_code: Job, with_optimizer: bool) -> None:
    """nn.Module keeps its fast path in every module, the root's forward still timed, once the
    root is known."""
    from torch.nn.modules import module

    num_steps = hooks.DISCOVERY_STEPS + 2
    model = build_model()
    optimizer = SGD(model.parameters(), lr=0.01) if with_optimizer else None
    for batch in build_loader(num_steps):
        loss = loss_of(model, batch)
        if optimizer is not None:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert not module._global_forward_pre_hooks
    assert not module._global_forward_hooks
    assert hooked_modules(model) == []
    rows = zero_code.steps()
    assert len(rows) == num_steps
    assert all(row["forward_s"] > 0 for row in rows), rows
    assert model._compiled_call_impl is None  # uninstalled


def test_a_model_copied_and_saved_after_discovery_trains_on(zero_code: Job) -> None:
    """copy.deepcopy (an EMA model) and torch.save of the root, as without stepscope."""
    num_steps = hooks.DISCOVERY_STEPS + 3
    model = build_model()
    optimizer = SGD(model.parameters(), lr=0.01)
    for index, batch in enumerate(build_loader(num_steps)):
        if index == num_steps - 1:
            ema = copy.deepcopy(model)
            torch.save(model, io.BytesIO())
            assert ema._compiled_call_impl is None
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
    assert_training_steps(zero_code.steps(), num_steps, samples=BATCH)


def test_distributed_checkpoint_save_and_load_are_phases(zero_code: Job, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = build_model()
    optimizer = SGD(model.parameters(), lr=0.01)
    for batch in build_loader(2):
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "ckpt")
    state = {"model": build_model().state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "ckpt")

    assert len(zero_code.steps()) == 2
    assert zero_code.phases() == ["checkpoint_save", "checkpoint_load"]
    assert torch.equal(state["model"]["0.weight"], model.state_dict()["0.weight"])
