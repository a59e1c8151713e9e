"""An adapter's profiler: the process's running one (zero-code's, or the user's), or a new
one from `stepscope.init()`; either way its steps are the adapter's from now on."""

from __future__ import annotations

from typing import Any

import stepscope
from stepscope.profiler import session
from stepscope.profiler.auto import passive
from stepscope.profiler.base import Profiler
from stepscope.schema import StepRule


def claim_profiler(owner: StepRule, **init_options: Any) -> Profiler:
    """The profiler whose steps `owner` marks from now on (a no-op one when profiling is off).

    `init_options` go to `stepscope.init()` when nothing profiles this process yet. DDP models,
    pipeline stages and torch.distributed.checkpoint calls are watched from now on too."""
    running = session.claim(owner)
    if running is None:
        stepscope.init(**init_options)
        running = session.claim(owner)
        if running is None:  # profiling is off
            return Profiler()
    profiler = running.profiler
    profiler.step_rule = owner
    passive.install()
    return profiler
