"""Finished steps on their way to the collector: the training thread hands each one over, and
the shipper thread turns those whose marks all happened into wire rows before it builds a
batch, without blocking (a device event or an async collective may still be pending)."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from stepscope.profiler.collectives.calls import CollectiveCall
from stepscope.profiler.collectives.groups import GroupRegistry
from stepscope.profiler.loop.steps import StepRecord
from stepscope.profiler.timer import Clock

MAX_UNRESOLVED_STEPS = 64
"""A finished step still waiting for a mark (a device event, an async collective) with this
many newer steps behind it is shipped with the marks that happened."""
MAX_HELD_STEPS = 8192
"""Finished steps held for the shipper thread to turn into rows (a 2.2 s flush of 0.27 ms
steps); past this many (that thread stuck in a long POST, or gone) the training thread turns
them into rows itself."""

AddRow = Callable[[str, dict[str, Any]], None]


class FinishedSteps:
    """The finished steps not yet turned into rows, in step order."""

    def __init__(
        self, add_row: AddRow, *, clock: Clock, groups: GroupRegistry, close_timeout_s: float
    ) -> None:
        self._add_row = add_row
        self.clock = clock
        """Replaceable before the first step (the profiler moves to CUDA events)."""
        self._groups = groups
        self._close_timeout_s = close_timeout_s
        self._held: deque[StepRecord] = deque()
        self._lock = threading.Lock()
        """Held by whichever thread is turning steps into rows."""
        self._error: BaseException | None = None
        """What went wrong on the shipper thread; raised on the training thread."""

    def __len__(self) -> int:
        return len(self._held)

    def append(self, record: StepRecord) -> None:
        """Hand over a finished step (the training thread). Raises what went wrong on the
        shipper thread (the profiler then turns itself off)."""
        self._held.append(record)
        if self._error is not None:
            raise self._error
        if len(self._held) > MAX_HELD_STEPS and self._lock.acquire(blocking=False):
            try:
                self._ship(force=False)
            finally:
                self._lock.release()

    def ship_ready(self) -> None:
        """Turn the steps whose marks all happened into rows (the shipper thread, before it
        builds a batch). An error is kept for the training thread."""
        try:
            with self._lock:
                self._ship(force=False)
        except Exception as exc:
            self._error = exc

    def flush(self) -> None:
        """Turn every step into rows, waiting up to close_timeout_s in all for pending marks
        (at close)."""
        with self._lock:
            if self._error is not None:  # the shipper thread's, after the last step
                raise self._error
            self._ship(force=True)

    def calls(self) -> list[CollectiveCall]:
        """The collectives of the held steps (read by the watchdog thread)."""
        calls: list[CollectiveCall] = []
        for record in list(self._held):
            calls.extend(record.calls)
        return calls

    def _ship(self, *, force: bool) -> None:
        """Ship the oldest steps whose marks all happened (blocks only when forced). The caller
        holds the lock."""
        clock = self.clock
        held = self._held
        deadline = time.monotonic() + self._close_timeout_s  # one budget for all steps
        while held:
            record = held[0]
            if not record.is_resolved(clock):
                if force:
                    _wait_for(record, clock, deadline=deadline)
                elif len(held) <= MAX_UNRESOLVED_STEPS:
                    return
            held.popleft()
            row, collective_rows = record.to_rows(clock, self._groups.mesh_dims)
            self._add_row("steps", row)
            for collective_row in collective_rows:
                self._add_row("collectives", collective_row)
            if record.custom:
                event = {"ts": row["ts"], "kind": "custom", "message": "record"}
                event["attributes"] = json_safe({"step": record.step, **record.custom})
                self._add_row("events", event)


def _wait_for(record: StepRecord, clock: Clock, *, deadline: float) -> None:
    """Block (only at close) until the record's marks happened, or time.monotonic() passed
    `deadline`."""
    for call in record.calls:
        while call.end is None and time.monotonic() < deadline:
            time.sleep(0.001)
        if call.end is not None:
            clock.wait(call.end)
    for _, _, end in record.spans:
        clock.wait(end)


def json_safe(value: Any) -> Any:
    """`value` as JSON can carry it: keys as strings, non-finite floats as None, a one-element
    tensor as its number, anything else unknown as its str()."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return json_safe(value.item())
    return str(value)
