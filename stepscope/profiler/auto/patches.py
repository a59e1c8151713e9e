"""Attributes zero-code replaced and hooks it registered, each undone by `undo()`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Patches:
    """What was patched, in order; `undo()` restores it in reverse."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace `owner.name` by `make(original)`."""
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def handle(self, handle: Any) -> None:
        """A torch RemovableHandle, removed on undo."""
        self.on_undo(handle.remove)

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Call `undo` on undo, in its turn."""
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:
                log.debug("stepscope: a patch did not undo cleanly", exc_info=True)
