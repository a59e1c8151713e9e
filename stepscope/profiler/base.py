"""The `Profiler` interface, whose base class is the no-op used when profiling is off.

This module imports nothing else of the profiler: the active implementation
(stepscope.profiler.active) subclasses it, and `setup.init()` picks one of the two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Literal, TypeVar

T = TypeVar("T")


class _NullContext:
    """A reusable context manager that does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


NULL_CONTEXT = _NullContext()


class Profiler:
    """Profiles one training rank. This base class is the no-op used when disabled."""

    enabled = False
    step_rule: str | None = None
    """What marks this profiler's steps, stored with each (schema.STEP_RULES); None for the
    user's own step() blocks."""

    def step(self, step: int | None = None) -> AbstractContextManager[None]:
        """Context manager around one training step (step_s; steps count from 0 unless given)."""
        return NULL_CONTEXT

    def section(self, name: str) -> AbstractContextManager[None]:
        """Context manager timing a part of the step: forward, backward, optimizer, h2d, or any."""
        return NULL_CONTEXT

    def begin_step(self, step: int | None = None) -> None:
        """Open a step from a callback, as entering `step()` does; `end_step()` closes it."""

    def end_step(self, *, failed: bool = False) -> None:
        """Close the step that `begin_step()` opened (nothing happens when none is open)."""

    def begin_section(self, name: str) -> None:
        """Open a section of the current step from a callback, as entering `section()` does."""

    def end_section(self, name: str) -> None:
        """Close the innermost open section called `name` (nothing happens when none is)."""

    def record_data_wait(self, waited_s: float, *, started_at: float) -> None:
        """Count `waited_s` blocked on input as data_s, from a callback; `started_at` is the
        wait's start on `time.perf_counter()` (before a step, it also starts the next step)."""

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Context manager around a declared phase (checkpoint_save, checkpoint_load, eval,
        compile, or any name): hang detection waits much longer while it lasts."""
        return NULL_CONTEXT

    def resumed_from(self, step: int) -> None:
        """Declare the step this run resumes at (the first step it executes after loading a
        checkpoint): steps from it on that an earlier incarnation ran count as lost progress.
        Declared before the first step, the profiler's own step numbers start there."""

    def wrap_dataloader(self, loader: Iterable[T]) -> Iterable[T]:
        """The loader, iterating as before, with the time blocked in next() counted as data_s."""
        return loader

    def watch(self, model: Any) -> None:
        """Time a DistributedDataParallel model's gradient all-reduces (Config.comm_timing)."""

    def record(
        self, *, tokens: int | None = None, samples: int | None = None, **custom: Any
    ) -> None:
        """Attach work counts (and any other values) to the current step."""

    def event(self, kind: str, message: str, **attributes: Any) -> None:
        """Send an event (kind one of schema.EVENT_KINDS) to the collector."""

    def measure_flops(self, fn: Callable[[], object]) -> float | None:
        """Count the FLOPs of `fn()` (e.g. one forward+backward) and use them as flops per step."""
        return None

    def close(self) -> None:
        """Flush what is buffered (bounded by close_timeout_s) and stop profiling."""

    def __enter__(self) -> Profiler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        self.close()
        return False
