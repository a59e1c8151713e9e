"""Clocks that timestamp work without blocking: perf_counter on CPU, CUDA events on GPU.

A clock hands out opaque marks on the hot path (`mark()`), and answers later, off the
hot path, whether a mark has happened yet (`is_ready`) and how many seconds separate two
marks (`seconds_between`). The CUDA clock records events on the current stream and
resolves them with the non-blocking `Event.query()`; nothing here synchronizes.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

Mark = Any
"""A float (CPU clock) or a recorded torch.cuda.Event (CUDA clock)."""


class Clock(Protocol):
    """What the profiler needs from a clock."""

    name: str

    def mark(self) -> Mark:
        """A timestamp of 'now' on this clock's timeline (on GPU: the current stream's)."""
        ...

    def is_ready(self, mark: Mark) -> bool:
        """Whether the mark's moment has passed, without blocking."""
        ...

    def seconds_between(self, start: Mark, end: Mark) -> float:
        """Seconds from `start` to `end`; both must be ready."""
        ...

    def wait(self, mark: Mark) -> None:
        """Block until the mark is ready (only for close(), never on the hot path)."""
        ...


class CpuClock:
    """Host wall clock (time.perf_counter); every mark is ready at once."""

    name = "cpu"

    mark = staticmethod(time.perf_counter)
    """The builtin itself: one call on the hot path, no Python frame."""

    def is_ready(self, mark: Mark) -> bool:
        return True

    def seconds_between(self, start: Mark, end: Mark) -> float:
        return float(end) - float(start)

    def wait(self, mark: Mark) -> None:
        return None


class CudaClock:
    """Device timeline: timing-enabled CUDA events recorded on the current stream.

    Built on the training thread, whose current device its events are recorded on. Other
    threads (the shipper's, the watchdog's) query them: a thread's current device is 0 until
    it sets one, and its first CUDA call would create a context on GPU 0 (~0.5 GiB of it for
    each rank of a node not on GPU 0), so each thread sets the clock's device before its
    first query."""

    name = "cuda"

    def __init__(self) -> None:
        import torch

        self._event_cls = torch.cuda.Event
        self._set_device = torch.cuda.set_device
        self.device_index: int = torch.cuda.current_device()
        self._thread = threading.local()
        """`on_device` is True in the threads whose current device is this clock's."""
        self._thread.on_device = True

    def mark(self) -> Any:
        event = self._event_cls(enable_timing=True)
        event.record()
        return event

    def is_ready(self, mark: Mark) -> bool:
        self._on_device()
        return bool(mark.query())

    def seconds_between(self, start: Mark, end: Mark) -> float:
        self._on_device()
        return float(start.elapsed_time(end)) / 1000.0

    def wait(self, mark: Mark) -> None:
        self._on_device()
        mark.synchronize()

    def _on_device(self) -> None:
        """Make this clock's device the calling thread's current one (once per thread)."""
        if not getattr(self._thread, "on_device", False):
            self._set_device(self.device_index)
            self._thread.on_device = True


def build_clock(device_type: str) -> Clock:
    """The clock for a device type: CUDA events for "cuda", perf_counter otherwise."""
    if device_type == "cuda":
        return CudaClock()
    return CpuClock()


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end] intervals, in the intervals' unit."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total
