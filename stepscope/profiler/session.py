"""The process's one profiler, and who marks its steps: the user, zero-code or an adapter.

`init()`, zero-code (profiler/auto) and the framework adapters (stepscope.integrations) meet
here, so that a job is counted once whoever starts profiling first: the first one makes the
profiler, and the steps belong to whoever claimed them last (an adapter or the user's own
`step()` knows the loop better than zero-code's inference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stepscope.profiler.base import Profiler


@dataclass(slots=True)
class Session:
    """This process's profiler and the owner of its steps."""

    profiler: Profiler
    owner: str
    """Who opens and closes steps: "auto" (zero-code), an adapter's name, or "user"."""
    release: Callable[[], None] | None = None
    """Called once when another owner claims the steps (e.g. zero-code closes its open step)."""


_session: Session | None = None
_starters: list[Callable[[], None]] = []
"""What may start a profiler on demand (zero-code's activation, when it is installed)."""


def current() -> Session | None:
    """This process's session; None before anything started profiling."""
    return _session


def running_profiler() -> Profiler | None:
    """This process's profiler, started on demand (by zero-code) if none runs yet."""
    if _session is None:
        for start_one in _starters:
            start_one()
    return _session.profiler if _session is not None else None


def start_on_demand(starter: Callable[[], None]) -> None:
    """Let `running_profiler()` call `starter` when nothing profiles this process yet."""
    _starters.append(starter)


def start(profiler: Profiler, owner: str, release: Callable[[], None] | None = None) -> Session:
    """Make `profiler` this process's profiler, its steps marked by `owner`."""
    global _session
    _session = Session(profiler=profiler, owner=owner, release=release)
    return _session


def claim(owner: str) -> Session | None:
    """Hand the steps of this process's profiler to `owner`; None when none was started."""
    session = _session
    if session is None or session.owner == owner:
        return session
    previous, session.release = session.release, None
    session.owner = owner
    if previous is not None:
        previous()
    return session


def end() -> None:
    """Forget this process's profiler (it was closed)."""
    global _session
    _session = None


def forget_starters() -> None:
    """No profiler starts on demand any more (zero-code uninstalled)."""
    _starters.clear()
