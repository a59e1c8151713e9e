"""The floor of any Python instrumentation of a training loop at stepscope's entry points.

`FloorProfiler` has the calls of the loop that `profiler_cost.profiled_segment` instruments
(`wrap_dataloader`, `step()`, `section()`, `record()`), and `install_tap()` wraps the same
ProcessGroup methods and `Work.wait` as stepscope's collective tap. Each entry point reads
the clock where stepscope's does and keeps one tuple, and the step's tuples are dropped at
its end (or, with `keep_steps`, kept that many steps, as stepscope keeps its records until a
batch is built): no threads, no shipping, no checks. What stepscope adds to a step
beyond what this adds is its own; what this adds, any Python profiler timing these points
pays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from time import perf_counter
from typing import Any

from torch._C._distributed_c10d import ProcessGroup, Work

from stepscope.profiler.collectives.tap import PG_METHODS


class _Span:
    __slots__ = ("floor", "name", "start_s", "ends_step")

    def __init__(self, floor: FloorProfiler, name: str, ends_step: bool) -> None:
        self.floor, self.name, self.ends_step = floor, name, ends_step

    def __enter__(self) -> None:
        self.start_s = perf_counter()

    def __exit__(self, *exc: object) -> None:
        marks = self.floor.marks
        marks.append((self.name, self.start_s, perf_counter()))
        if self.ends_step:
            self.floor.end_step()


class FloorProfiler:
    """Clock reads and one tuple per entry point, dropped every step or every `keep_steps`."""

    def __init__(self, keep_steps: int = 0) -> None:
        self.marks: list[Any] = []
        self.keep_steps = keep_steps
        self.kept: list[list[Any]] = []

    def end_step(self) -> None:
        if self.keep_steps:
            self.kept.append(self.marks.copy())
            if len(self.kept) >= self.keep_steps:
                self.kept.clear()
        self.marks.clear()

    def wrap_dataloader(self, batches: Iterable[Any]) -> Iterator[Any]:
        marks = self.marks
        iterator = iter(batches)
        while True:
            start_s = perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            marks.append(("data", start_s, perf_counter()))
            yield batch

    def step(self) -> _Span:
        return _Span(self, "step", True)

    def section(self, name: str) -> _Span:
        return _Span(self, name, False)

    def record(self, **values: Any) -> None:
        self.marks.append(values)

    def install_tap(self) -> None:
        """Wrap the tap's ProcessGroup methods and Work.wait for the life of the process."""
        for name in PG_METHODS:
            original = ProcessGroup.__dict__.get(name)
            if original is not None:
                setattr(ProcessGroup, name, self._issued(original))
        setattr(Work, "wait", self._waited(Work.__dict__["wait"]))  # noqa: B010

    def _issued(self, original: Callable[..., Any]) -> Callable[..., Any]:
        marks = self.marks
        name = original.__name__

        def wrapper(pg: Any, *args: Any, **kwargs: Any) -> Any:
            start_s = perf_counter()
            work = original(pg, *args, **kwargs)
            marks.append((name, start_s))
            return work

        return wrapper

    def _waited(self, original: Callable[..., Any]) -> Callable[..., Any]:
        marks = self.marks

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            start_s = perf_counter()
            try:
                return original(work, *args, **kwargs)
            finally:
                marks.append(("wait", start_s, perf_counter()))

        return wait
