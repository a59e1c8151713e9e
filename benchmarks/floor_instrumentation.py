"""The floor of any Python instrumentation of a training loop at stepscope's entry points.

`FloorProfiler` has the calls of the loop that `profiler_cost.profiled_segment` instruments
(`wrap_dataloader`, `step()`, `section()`, `record()`), and `install_tap()` wraps the same
ProcessGroup methods and `Work.wait` as stepscope's collective tap. Each entry point reads
the clock where stepscope's does and keeps one tuple, and the step's tuples are dropped at
its end: no records kept, no threads, no shipping, no checks. What stepscope adds to a step
beyond what this adds is its own; what this adds, any Python profiler timing these points
pays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from time import perf_counter
from typing import Any

from torch._C._distributed_c10d import ProcessGroup, Work

from stepscope.profiler.tap import PG_METHODS


class _Span:
    __slots__ = ("marks", "name", "start_s", "ends_step")

    def __init__(self, marks: list[Any], name: str, ends_step: bool) -> None:
        self.marks, self.name, self.ends_step = marks, name, ends_step

    def __enter__(self) -> None:
        self.start_s = perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.marks.append((self.name, self.start_s, perf_counter()))
        if self.ends_step:
            self.marks.clear()


class FloorProfiler:
    """Clock reads and one tuple per entry point, dropped every step."""

    def __init__(self) -> None:
        self.marks: list[Any] = []

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
        return _Span(self.marks, "step", True)

    def section(self, name: str) -> _Span:
        return _Span(self.marks, name, False)

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

        def wrapper(pg: Any, *args: Any, **kwargs: Any) -> Any:
            start_s = perf_counter()
            work = original(pg, *args, **kwargs)
            marks.append((pg, start_s, work))
            return work

        return wrapper

    def _waited(self, original: Callable[..., Any]) -> Callable[..., Any]:
        marks = self.marks

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            start_s = perf_counter()
            try:
                return original(work, *args, **kwargs)
            finally:
                marks.append((work, start_s, perf_counter()))

        return wait
