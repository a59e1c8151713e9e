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

_PHASES = {"save": "checkpoint_save", "async_save": "checkpoint_save", "load": "checkpoint_load"}
"""torch.distributed.checkpoint's functions that are phases."""
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
    when_imported(
        "torch.nn.parallel.distributed",
        lambda module: _watch_after_init(patches, module.DistributedDataParallel),
    )
    when_imported(
        "torch.distributed.pipelining.stage",
        lambda module: _watch_after_init(patches, module._PipelineStageBase),
    )
    when_imported("torch.distributed.checkpoint", lambda m: _checkpoint_phases(patches, m))


def uninstall() -> None:
    """Undo what install() patched (tests; a process that stops profiling)."""
    while _installed:
        _installed.pop().undo()
    session.forget_starters()


def _watch_after_init(patches: Patches, cls: type) -> None:
    """`profiler.watch(obj)` after each `cls(...)` is built (watch() takes a model once)."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            profiler = session.running_profiler()
            if profiler is not None:
                profiler.watch(self)

        return __init__

    patches.wrap(cls, "__init__", make)


def _checkpoint_phases(patches: Patches, module: ModuleType) -> None:
    """dcp.save / async_save / load (and their modules' own names) as phases."""
    for name, phase in _PHASES.items():
        owner = module.state_dict_loader if phase == "checkpoint_load" else module.state_dict_saver
        original = getattr(owner, name, None)
        if original is None:
            continue
        wrapped = _in_phase(original, phase)
        patches.wrap(owner, name, functools.partial(_replacement, wrapped))
        if getattr(module, name, None) is original:  # dcp.save is state_dict_saver.save
            patches.wrap(module, name, functools.partial(_replacement, wrapped))


def _replacement(wrapped: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    return wrapped


def _in_phase(fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        profiler = session.running_profiler()
        if profiler is None:
            return fn(*args, **kwargs)
        with profiler.phase(phase):
            return fn(*args, **kwargs)

    return call
