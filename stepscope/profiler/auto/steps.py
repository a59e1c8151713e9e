"""Steps inferred from what the training loop does, for code that never calls `step()`.

The loop's signals (a data-loader wait, a root module's forward, backward, an optimizer
update) arrive here in order; the rule of DESIGN §9 turns them into steps on the profiler:
a step ends at the first data wait, training forward or backward that follows an optimizer
update. So several optimizers, an optimizer container, ZeRO's sub-group steps and gradient
accumulation make one step each update, and an AMP step that the scaler skipped still ends
its step (the scaler's `step()` is a signal of its own). A forward with grad off or in eval
mode, once an optimizer exists and between updates, is evaluation once a data wait or a second
such forward follows it (an `eval` phase), and otherwise part of the next step (a
distillation teacher's forward). A job with no optimizer (or
one whose backwards never reach one) steps per data-loader batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from stepscope.profiler.base import Profiler
from stepscope.schema import StepRule

BACKWARDS_WITHOUT_UPDATE = 8
"""Backward passes in one step with no optimizer update ever seen, after which the job is taken
for one that updates without an optimizer (and stepped per data-loader batch)."""


class StepInference:
    """Opens and closes the profiler's steps, sections and eval phases from the loop's signals."""

    def __init__(self, profiler: Profiler, *, has_optimizer: bool = False) -> None:
        self.profiler = profiler
        self.has_optimizer = has_optimizer
        """An optimizer was built in this process (a no-grad forward is then evaluation)."""
        self.rule: StepRule = "optimizer"
        self.num_steps = 0
        """Steps opened so far."""
        self._in_step = False
        self._updated = False
        """An optimizer update ran in the open step."""
        self._ever_updated = False
        self._backwards = 0
        self._optimizer_depth = 0
        self._backward_depth = 0
        self._forward_open = 0
        self._samples = 0
        self._pending_wait: tuple[float, float] | None = None
        """(start, waited_s) of the data waits since the last step ended, not yet given: an
        eval phase may claim them."""
        self._eval: AbstractContextManager[None] | None = None
        self._maybe_eval = False
        """A no-grad forward ran between updates: evaluation's first, or part of the next step
        (a distillation teacher's); a data wait or a second one makes it evaluation."""

    # ---- signals ---------------------------------------------------------------------------

    def data_wait_begins(self) -> None:
        if self._in_step and (self._updated or self.rule == "dataloader"):
            self._close_step()

    def data_waited(self, start: float, waited_s: float, batch: Any) -> None:
        if self._maybe_eval:  # an input pipeline between no-grad forwards: evaluation
            self._open_eval()
        if self._eval is not None:  # evaluation's input, or the next step's: its forward says
            self._pending_wait = (start, waited_s)
            self._samples = batch_size(batch)
            return
        if self._in_step:
            self.profiler.record_data_wait(waited_s, started_at=start)
        elif self._pending_wait is None:
            self._pending_wait = (start, waited_s)
        else:
            self._pending_wait = (self._pending_wait[0], self._pending_wait[1] + waited_s)
        self._samples += batch_size(batch)
        if not self.has_optimizer:
            self.rule = "dataloader"
        if self.rule == "dataloader" and not self._in_step:
            self._open_step()

    def forward_begins(self, training: bool) -> bool:
        """A root module's forward begins; True when it is timed as a section of a step."""
        if not training:
            if not self.has_optimizer and not self._in_step:
                return False  # inference between data-loader batches: in no step
            if self.has_optimizer and (not self._in_step or self._updated):
                self._begin_eval()
                return False
        if self._eval is not None or self._maybe_eval:
            self._end_eval()
        if self._in_step and self._updated:
            self._close_step()
        if not self._in_step:
            self._open_step()
        self._forward_open += 1
        if self._forward_open == 1:
            self.profiler.begin_section("forward")
        return True

    def forward_ends(self) -> None:
        self._forward_open -= 1
        if self._forward_open == 0:
            self.profiler.end_section("forward")

    def backward_begins(self) -> None:
        self._backward_depth += 1
        if self._backward_depth > 1:
            return
        if self._eval is not None or self._maybe_eval:
            self._end_eval()
        if self._in_step and self._updated and self.rule == "optimizer":
            self._close_step()
        if not self._in_step:
            self._open_step()
        self._backwards += 1
        self.profiler.begin_section("backward")

    def backward_ends(self) -> None:
        self._backward_depth -= 1
        if self._backward_depth > 0:
            return
        self.profiler.end_section("backward")
        if (
            self.rule == "optimizer"
            and not self._ever_updated
            and self._backwards >= BACKWARDS_WITHOUT_UPDATE
        ):
            self.rule = "dataloader"

    def optimizer_begins(self) -> None:
        self._optimizer_depth += 1
        if self._optimizer_depth > 1:
            return  # an inner optimizer of a container or a scaler: the same update
        if self._eval is not None or self._maybe_eval:
            self._end_eval()
        if self.rule == "dataloader" and self.has_optimizer:
            self.rule = "optimizer"
        if not self._in_step:
            self._open_step()
        self.profiler.begin_section("optimizer")

    def optimizer_ends(self) -> None:
        self._optimizer_depth -= 1
        if self._optimizer_depth > 0:
            return
        self.profiler.end_section("optimizer")
        self._updated = self._ever_updated = True

    def finish(self, *, failed: bool = False) -> None:
        """Close what is open (the process ends, or another owner takes the steps); `failed`:
        the open step raised."""
        while self._forward_open > 0:
            self.forward_ends()
        if self._eval is not None or self._maybe_eval:
            self._end_eval()
        if self._in_step:
            self._close_step(failed=failed)

    # ---- steps -----------------------------------------------------------------------------

    def _open_step(self) -> None:
        profiler = self.profiler
        if self._pending_wait is not None:
            start, waited_s = self._pending_wait
            self._pending_wait = None
            profiler.record_data_wait(waited_s, started_at=start)
        profiler.step_rule = self.rule
        profiler.begin_step()
        self._in_step = True
        self.num_steps += 1

    def _close_step(self, *, failed: bool = False) -> None:
        if self._samples:
            self.profiler.record(samples=self._samples)
            self._samples = 0
        self.profiler.end_step(failed=failed)
        self._in_step = self._updated = False
        self._backwards = 0

    def _begin_eval(self) -> None:
        if self._in_step:
            self._close_step()
        if self._eval is None and not self._maybe_eval:
            self._maybe_eval = True
            return
        self._open_eval()

    def _open_eval(self) -> None:
        self._maybe_eval = False
        if self._eval is None:
            self._eval = self.profiler.phase("eval")
            self._eval.__enter__()
        self._pending_wait = None  # the waits since the last step were evaluation's
        self._samples = 0

    def _end_eval(self) -> None:
        self._maybe_eval = False
        if self._eval is not None:
            self._eval.__exit__(None, None, None)
            self._eval = None


def batch_size(batch: Any) -> int:
    """Samples in a batch that is a tensor, or a tuple, list or mapping whose first value is one;
    0 when it cannot tell."""
    # The common case first, with no abstract-class check; a tuple of types is checked ~5x
    # faster than the union `tuple | list`.
    if isinstance(batch, (tuple, list)):
        batch = batch[0] if batch else None
    elif isinstance(batch, Mapping):
        batch = next(iter(batch.values()), None)
    shape = getattr(batch, "shape", None)
    try:
        return int(shape[0]) if shape else 0
    except (TypeError, IndexError):
        return 0
