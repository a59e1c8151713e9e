"""Lightning: a callback that marks one stepscope step per optimizer update.

Under `stepscope run` the Trainer adds it by itself, through Lightning's callbacks entry
points (pyproject.toml); without it, `Trainer(callbacks=[StepscopeCallback()])`. The Trainer
checks that a callback is an instance of its own package's `Callback`, and the standalone
`pytorch_lightning` and the unified `lightning.pytorch` have one each: the class is built for
the package that asks (`callback_class`). This module imports neither until then.

What the hooks mark (pytorch_lightning 2.6: loops/training_epoch_loop.py,
loops/optimization/automatic.py, plugins/precision/precision.py):
- on_train_batch_start, which Lightning calls once the batch is fetched and on the device: the
  time since the previous batch ended (or eval, a checkpoint save, the epoch's start) is data
  wait; after an update the step opens, numbered by `global_step`; forward opens.
- on_before_zero_grad (automatic optimization zeroes after training_step) or on_before_backward
  closes forward; on_before_backward..on_after_backward is backward.
- on_before_optimizer_step..on_train_batch_end is optimizer: gradient clipping, the update and
  the step-interval LR schedulers.
- on_train_batch_end closes the step once `global_step` moved: with gradient accumulation the
  micro-batches before the update (each its own on_train_batch_*) belong to its step.
- on_validation_start..on_validation_end is the "eval" phase, `trainer.save_checkpoint` the
  "checkpoint_save" phase (on_save_checkpoint fires before the file is written, and no hook
  after it).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

from stepscope.integrations.claim import claim_profiler
from stepscope.profiler import session
from stepscope.profiler.auto.steps import batch_size
from stepscope.profiler.base import Profiler
from stepscope.profiler.config import parse_bool

log = logging.getLogger(__name__)

Package = Literal["pytorch_lightning", "lightning.pytorch"]
Hook = Callable[..., None]

_failure_said = False


def pytorch_lightning_callbacks() -> list[Any]:
    """Entry point `pytorch_lightning.callbacks_factory`: the callback under `stepscope run`."""
    return _auto_callbacks("pytorch_lightning")


def lightning_callbacks() -> list[Any]:
    """Entry point `lightning.pytorch.callbacks_factory`: the callback under `stepscope run`."""
    return _auto_callbacks("lightning.pytorch")


@functools.cache
def callback_class(package: Package) -> type:
    """StepscopeCallback for `package`: its `Callback`, with stepscope's hooks."""
    base = importlib.import_module(package).Callback
    return type("StepscopeCallback", (_StepMarks, base), {"__module__": __name__})


def __getattr__(name: str) -> Any:
    """`StepscopeCallback`: the callback class of the Lightning package in use."""
    if name == "StepscopeCallback":
        return callback_class(_package_in_use())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fail_open(*, gated: bool) -> Callable[[Hook], Hook]:
    """Run a hook, never raising into training: on an error, say so once and stop marking.
    A `gated` hook does nothing while the callback is not marking (before setup("fit"))."""

    def decorate(hook: Hook) -> Hook:
        @functools.wraps(hook)
        def run(self: _StepMarks, *args: Any, **kwargs: Any) -> None:
            if gated and not self._marking:
                return
            try:
                hook(self, *args, **kwargs)
            except Exception:
                self._marking, self._failed = False, True
                _say_failure_once()

        return run

    return decorate


class _StepMarks:
    """StepscopeCallback's hooks; the Lightning package's `Callback` follows it in the MRO."""

    def __init__(self, *, auto: bool = False, **init_options: Any) -> None:
        """`init_options` go to `stepscope.init()` when nothing profiles the process yet;
        `auto`: added by the entry point (a callback the user added wins)."""
        super().__init__()
        self.auto = auto
        self._init_options = init_options
        self._profiler = Profiler()
        self._owns_profiler = False
        self._marking = False
        self._failed = False
        self._section: str | None = None
        self._step_global: int | None = None
        """`global_step` when the open step began; None when no step is open."""
        self._idle_since: float | None = None
        """perf_counter() when the loop last left training or eval work: data wait from then."""
        self._num_batches = 0
        self._num_samples = 0
        self._eval: AbstractContextManager[None] | None = None
        self._saving: AbstractContextManager[None] | None = None
        self._trainer: Any = None
        self._unwrap: Callable[[], None] | None = None

    # ---- fit lifecycle ---------------------------------------------------------------------

    @_fail_open(gated=False)
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self._failed or not self._chosen(trainer):
            return
        if "RANK" not in os.environ and trainer.world_size > 1:
            # Lightning's own launcher (devices=N without torchrun) sets LOCAL_RANK and
            # WORLD_SIZE but not RANK, which the profiler reads (as its DeepSpeed strategy does).
            os.environ["RANK"] = str(trainer.global_rank)
        running = session.current()
        self._profiler = claim_profiler("lightning", **self._init_options)
        # The user closes the profiler they started; zero-code closes its own only while it
        # marks the steps, so one it started is the callback's to close from now on.
        self._owns_profiler = self._profiler.enabled and (
            running is None or running.owner != "user"
        )
        self._marking = self._profiler.enabled
        if self._marking:
            self._wrap_save_checkpoint(trainer)

    @_fail_open(gated=True)
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step > 0:
            self._profiler.resumed_from(trainer.global_step)
        self._idle_since = time.perf_counter()

    @_fail_open(gated=True)
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._idle_since = time.perf_counter()

    @_fail_open(gated=True)
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_step(pl_module)

    @_fail_open(gated=False)
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._finish(None)

    @_fail_open(gated=False)
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(exception)

    # ---- one step --------------------------------------------------------------------------

    @_fail_open(gated=True)
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self._close_section()
        since = self._idle_since if self._idle_since is not None else now
        self._profiler.record_data_wait(now - since, started_at=since)
        if self._step_global is None:
            self._step_global = trainer.global_step
            self._num_batches, self._num_samples = 0, 0
            self._profiler.begin_step(self._step_global)
        self._num_batches += 1
        self._num_samples += batch_size(batch)
        self._open_section("forward")

    @_fail_open(gated=True)
    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._close_section()

    @_fail_open(gated=True)
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._open_section("backward")

    @_fail_open(gated=True)
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._close_section()

    @_fail_open(gated=True)
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._open_section("optimizer")

    @_fail_open(gated=True)
    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step_global is not None and trainer.global_step != self._step_global:
            self._end_step(pl_module)
        else:
            self._close_section()
        self._idle_since = time.perf_counter()

    # ---- phases ----------------------------------------------------------------------------

    @_fail_open(gated=True)
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval = self._profiler.phase("eval")
        self._eval.__enter__()

    @_fail_open(gated=True)
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        phase, self._eval = self._eval, None
        if phase is not None:
            phase.__exit__(None, None, None)
        self._idle_since = time.perf_counter()

    @_fail_open(gated=True)
    def _save_begins(self) -> None:
        self._saving = self._profiler.phase("checkpoint_save")
        self._saving.__enter__()

    @_fail_open(gated=True)
    def _save_ends(self) -> None:
        phase, self._saving = self._saving, None
        if phase is not None:
            phase.__exit__(None, None, None)
        self._idle_since = time.perf_counter()

    # ---- helpers ---------------------------------------------------------------------------

    def _chosen(self, trainer: Any) -> bool:
        """Whether this callback marks the trainer's steps: the first of those the user added,
        else the first the entry point added (one set of marks per step)."""
        ours = [c for c in trainer.callbacks if isinstance(c, _StepMarks)]
        return next((c for c in ours if not c.auto), ours[0]) is self

    def _open_section(self, name: str) -> None:
        self._close_section()
        self._profiler.begin_section(name)
        self._section = name

    def _close_section(self) -> None:
        if self._section is not None:
            self._profiler.end_section(self._section)
            self._section = None

    def _end_step(self, pl_module: Any, *, failed: bool = False) -> None:
        """Close the open step with its work counts (no-op when none is open)."""
        self._close_section()
        if self._step_global is None:
            return
        self._step_global = None
        counts: dict[str, Any] = {"samples": self._num_samples or None}
        flops_per_batch = getattr(pl_module, "flops_per_batch", None)
        if isinstance(flops_per_batch, int | float):  # ThroughputMonitor's: per batch and device
            counts["flops"] = float(flops_per_batch) * self._num_batches
        self._profiler.record(**counts)
        self._profiler.end_step(failed=failed)

    def _wrap_save_checkpoint(self, trainer: Any) -> None:
        """Time `trainer.save_checkpoint` (ModelCheckpoint's, the user's) as a phase."""
        original = trainer.save_checkpoint
        previous = trainer.__dict__.get("save_checkpoint")
        marks = self

        @functools.wraps(original)
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            marks._save_begins()
            try:
                return original(*args, **kwargs)
            finally:
                marks._save_ends()

        def unwrap() -> None:
            if trainer.__dict__.get("save_checkpoint") is save_checkpoint:
                if previous is None:
                    del trainer.save_checkpoint
                else:
                    trainer.save_checkpoint = previous

        trainer.save_checkpoint = save_checkpoint
        self._trainer, self._unwrap = trainer, unwrap

    def _finish(self, failure: BaseException | None) -> None:
        """The fit ended (or failed): close the open step, and the profiler if it is ours."""
        trainer, self._trainer = self._trainer, None
        unwrap, self._unwrap = self._unwrap, None
        if unwrap is not None:
            unwrap()
        if self._marking:
            self._marking = False
            self._end_step(trainer.lightning_module, failed=failure is not None)
            for phase in (self._eval, self._saving):
                if phase is not None:
                    phase.__exit__(None, None, None)
            self._eval = self._saving = None
        if self._owns_profiler:
            self._owns_profiler = False
            if failure is None:
                self._profiler.close()
            else:  # says the exception (an event), then closes the profiler as failed
                self._profiler.__exit__(type(failure), failure, failure.__traceback__)


def _auto_callbacks(package: Package) -> list[Any]:
    """[the callback] when the job's stepscope environment asks for zero-code, else []."""
    try:
        auto = parse_bool(os.environ.get("STEPSCOPE_AUTO", ""))
        if not auto or parse_bool(os.environ.get("STEPSCOPE_DISABLED", "")):
            return []
        return [callback_class(package)(auto=True)]
    except Exception:
        _say_failure_once()
        return []


def _package_in_use() -> Package:
    """The Lightning package already imported, else the one installed (standalone first)."""
    if "lightning.pytorch" in sys.modules:
        return "lightning.pytorch"
    if "pytorch_lightning" in sys.modules or importlib.util.find_spec("pytorch_lightning"):
        return "pytorch_lightning"
    return "lightning.pytorch"


def _say_failure_once() -> None:
    global _failure_said
    if not _failure_said:
        _failure_said = True
        log.warning(
            "stepscope: the Lightning callback failed; training goes on unprofiled", exc_info=True
        )
