"""The CUDA clock sets its device in each thread that queries its events before the first CUDA
call there (else that call would create a context on GPU 0). No GPU here: torch.cuda's
events and device calls are replaced by fakes that log what they are asked."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from stepscope.profiler.timer import CudaClock

_DEVICE = 3


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(thread name, CUDA call) in call order."""
    log: list[tuple[str, str]] = []

    def called(what: str) -> None:
        log.append((threading.current_thread().name, what))

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at_ms = 0.0

        def record(self) -> None:
            called("record")
            self.at_ms = 10.0 * sum(what == "record" for _, what in log)

        def query(self) -> bool:
            called("query")
            return True

        def elapsed_time(self, end: Any) -> float:
            called("elapsed_time")
            return float(end.at_ms - self.at_ms)

        def synchronize(self) -> None:
            called("synchronize")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: _DEVICE)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: called(f"set_device({index})"))
    return log


def _in_thread(name: str, work: Any) -> None:
    thread = threading.Thread(target=work, name=name)
    thread.start()
    thread.join()


def test_each_thread_that_reads_the_events_sets_the_clocks_device_once_before_its_first_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = _fake_cuda(monkeypatch)
    clock = CudaClock()  # on the training thread, whose device is 3
    start, end = clock.mark(), clock.mark()
    seen: dict[str, Any] = {}

    def shipper() -> None:
        seen["ready"] = clock.is_ready(end)
        seen["seconds"] = clock.seconds_between(start, end)
        clock.wait(end)

    _in_thread("shipper", shipper)
    _in_thread("watchdog", lambda: clock.is_ready(start))
    assert clock.is_ready(end)  # the training thread's device is the clock's already

    assert seen == {"ready": True, "seconds": 0.01}
    assert log == [
        ("MainThread", "record"),
        ("MainThread", "record"),
        ("shipper", f"set_device({_DEVICE})"),
        ("shipper", "query"),
        ("shipper", "elapsed_time"),
        ("shipper", "synchronize"),
        ("watchdog", f"set_device({_DEVICE})"),
        ("watchdog", "query"),
        ("MainThread", "query"),
    ]
