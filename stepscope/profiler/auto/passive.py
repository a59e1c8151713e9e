"""What zero-code does for the process's profiler whoever marks its steps (zero-code, an
adapter or the user): a DDP model watched from the moment it is wrapped, a pipeline stage
learnt when it is built, and torch.distributed.checkpoint's save and load as phases."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from stepscope.profiler import session
from stepscope.profiler.auto.imports import when_imported
from stepscope.profiler.auto.patches import Patches
from stepscope.profiler.base import Profiler

ProfilerNow = Callable[[], Profiler | None]
"""The process's profiler now (zero-code may start one), None when nothing profiles."""

_CHECKPOINT_PHASES = {"save": "checkpoint_save", "async_save": "checkpoint_save"}
_LOAD_PHASES = {"load": "checkpoint_load"}
_installed: list[Patches] = []


def install(activate: Callable[[], None] | None = None) -> None:
    """Patch DDP, pipeline stages and torch.distributed.checkpoint once each is imported (once
    a process); `activate` starts zero-code's profiler when one of them needs a profiler."""
    if activate is not None:
        session.start_on_demand(activate)
    if _installed:
        return
    patches = Patches()
    _installed.append(patches)
    profiler_now = session.running_profiler
    when_imported(
        "torch.nn.parallel.distributed", lambda m: _watch_on_init(patches, m, profiler_now)
    )
    when_imported(
        "torch.distributed.pipelining.stage", lambda m: _watch_stages(patches, m, profiler_now)
    )
    when_imported(
        "torch.distributed.checkpoint", lambda m: _checkpoint_phases(patches, m, profiler_now)
    )


def uninstall() -> None:
    """Undo what install() patched (tests; a process that stops profiling)."""
    while _installed:
        _installed.pop().undo()
    session.forget_starters()


def _watch_on_init(patches: Patches, module: ModuleType, profiler_now: ProfilerNow) -> None:
    _watch_after_init(patches, module.DistributedDataParallel, profiler_now)


def _watch_stages(patches: Patches, module: ModuleType, profiler_now: ProfilerNow) -> None:
    _watch_after_init(patches, module._PipelineStageBase, profiler_now)


def _watch_after_init(patches: Patches, cls: type, profiler_now: ProfilerNow) -> None:
    """`profiler.watch(obj)` after each `cls(...)` is built (watch() takes a model once)."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            profiler = profiler_now()
            if profiler is not None:
                profiler.watch(self)

        return __init__

    patches.wrap(cls, "__init__", make)


def _checkpoint_phases(patches: Patches, module: ModuleType, profiler_now: ProfilerNow) -> None:
    """dcp.save / async_save / load (and their modules' own names) as phases."""
    saver = module.state_dict_saver
    loader = module.state_dict_loader
    for name, phase in {**_CHECKPOINT_PHASES, **_LOAD_PHASES}.items():
        owner = loader if name in _LOAD_PHASES else saver
        if not hasattr(owner, name):
            continue
        original = getattr(owner, name)
        wrapped = _in_phase(original, phase, profiler_now)
        patches.wrap(owner, name, functools.partial(_replacement, wrapped))
        if getattr(module, name, None) is original:  # dcp.save is state_dict_saver.save
            patches.wrap(module, name, functools.partial(_replacement, wrapped))


def _replacement(wrapped: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    return wrapped


def _in_phase(fn: Callable[..., Any], phase: str, profiler_now: ProfilerNow) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        profiler = profiler_now()
        if profiler is None:
            return fn(*args, **kwargs)
        with profiler.phase(phase):
            return fn(*args, **kwargs)

    return call
