"""Post-import hooks: run a callback once a module has finished importing, without importing it.

Zero-code must not import torch (or a framework) in a process that never does: it waits for
the import. A finder on `sys.meta_path` wraps the module's loader so that the callback runs
right after the module's own code; a module already imported gets its callback at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

log = logging.getLogger(__name__)

Callback = Callable[[ModuleType], None]


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` once `name` is imported (now, if it already is); never raises."""
    module = sys.modules.get(name)
    if module is not None and _is_initialised(module):
        _run(callback, module)
        return
    finder = _finder()
    finder.waiting.setdefault(name, []).append(callback)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a module that someone waits for."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[Callback]] = {}
        self._finding: set[str] = set()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.waiting or fullname in self._finding:
            return None
        self._finding.add(fullname)  # the real finders below us, not us again
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
            if spec is None:
                for finder in sys.meta_path:
                    if finder is self or not hasattr(finder, "find_spec"):
                        continue
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _CallbackLoader(spec.loader, self.waiting.pop(fullname))
        return spec


class _CallbackLoader(importlib.abc.Loader):
    """The module's own loader, then the callbacks waiting for it."""

    def __init__(self, loader: importlib.abc.Loader, callbacks: list[Callback]) -> None:
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for callback in self._callbacks:
            _run(callback, module)

    def __getattr__(self, name: str) -> object:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


def _finder() -> _PostImportFinder:
    for finder in sys.meta_path:
        if isinstance(finder, _PostImportFinder):
            return finder
    finder = _PostImportFinder()
    sys.meta_path.insert(0, finder)
    return finder


def _is_initialised(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def _run(callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:
        log.warning("stepscope: a hook on %s failed; it is off", module.__name__, exc_info=True)
