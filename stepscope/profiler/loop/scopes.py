"""The scopes of a training loop: a step, a section, a phase, the wrapped dataloader.

Each is a fresh object per use that takes clock marks and stores them on the profiler that
made it (`Loop`, the ActiveProfiler): plain attribute reads and writes, since they run in
every step (a property or a method call would cost a frame each). Fail-open: an internal
error turns the profiler off through its `_fail`, and never reaches the training loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Literal, Protocol

from stepscope.profiler.loop.steps import StepRecord
from stepscope.profiler.timer import Clock


class Loop(Protocol):
    """The profiler's state and steps that the scopes read and write."""

    _broken: bool
    _current: StepRecord | None
    """The step in progress."""
    _next_index: int
    _failed_step: int | None
    _clock: Clock
    _tap: Any
    _unobserved: list[Any]
    """The tap's async work not yet looked at, read inline at each boundary."""
    _section: str | None
    _phase: str | None
    _phase_changed_at: float | None
    _pre_data_start: float | None
    """When the first dataloader wait before the next step began."""
    _pre_data_s: float

    def _begin_step(self, index: int | None) -> None: ...

    def _end_step(self, *, failed: bool) -> None: ...

    def _fail(self, exc: BaseException) -> None: ...

    def record_data_wait(self, waited_s: float, *, started_at: float) -> None: ...

    def _lifecycle_event(self, kind: str, ts: float, **attributes: Any) -> None: ...


class Step:
    """Context manager for one step; a fresh one per step() call."""

    __slots__ = ("_prof", "_index")

    def __init__(self, prof: Loop, index: int | None) -> None:
        self._prof = prof
        self._index = index

    def __enter__(self) -> None:
        prof = self._prof
        if prof._broken:
            return
        try:
            prof._begin_step(self._index)
        except Exception as exc:
            prof._fail(exc)

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> Literal[False]:
        prof = self._prof
        if prof._broken:
            return False
        try:
            if exc_type is not None:
                prof._failed_step = self._index if self._index is not None else prof._next_index - 1
            prof._end_step(failed=exc_type is not None)
        except Exception as exc:
            prof._fail(exc)
        return False


class Section:
    """Context manager for one section of the current step."""

    __slots__ = ("_prof", "name", "_start", "_outer")

    def __init__(self, prof: Loop, name: str) -> None:
        self._prof = prof
        self.name = name
        self._start: Any = None
        self._outer: str | None = None

    def __enter__(self) -> None:
        prof = self._prof
        try:
            if prof._unobserved:  # a boundary: see Loop._unobserved
                prof._tap.observe()
            self._start = prof._clock.mark()
            self._outer, prof._section = prof._section, self.name  # for the watchdog
        except Exception as exc:
            prof._fail(exc)

    def __exit__(self, *_: object) -> Literal[False]:
        prof = self._prof
        prof._section = self._outer
        if prof._unobserved:
            prof._tap.observe()
        current = prof._current
        if current is None or self._start is None or prof._broken:
            return False
        try:
            current.spans.append((self.name, self._start, prof._clock.mark()))
        except Exception as exc:
            prof._fail(exc)
        return False


class Phase:
    """Context manager for a declared phase (checkpointing, eval, compilation...); shipped as
    a `phase` event (its start and duration) when it ends."""

    __slots__ = ("_prof", "_name", "_outer", "_start_ts", "_start")

    def __init__(self, prof: Loop, name: str) -> None:
        self._prof = prof
        self._name = name
        self._outer: str | None = None
        self._start_ts = 0.0
        self._start = 0.0

    def __enter__(self) -> None:
        prof = self._prof
        self._outer, prof._phase = prof._phase, self._name
        self._start_ts, self._start = time.time(), time.perf_counter()
        prof._phase_changed_at = self._start

    def __exit__(self, *_: object) -> Literal[False]:
        prof = self._prof
        prof._phase = self._outer
        now = time.perf_counter()
        prof._phase_changed_at = now
        if self._outer is None:  # a nested phase is part of its outer one: counted once
            prof._lifecycle_event(
                "phase", self._start_ts, name=self._name, duration_s=now - self._start
            )
        return False


class TimedLoader:
    """Iterates a loader, counting the time blocked in next() as data_s."""

    def __init__(self, loader: Iterable[Any], prof: Loop) -> None:
        self._loader = loader
        self._prof = prof

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self._loader)
        prof = self._prof
        clock = time.perf_counter
        while True:
            start = clock()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            prof.record_data_wait(clock() - start, started_at=start)
            yield batch

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
