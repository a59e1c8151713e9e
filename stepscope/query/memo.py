"""Answers computed from a job's rollups, kept in memory until its next analyzer pass.

Rollups and findings change only when a pass stores them, and each pass stamps the job's
`analysis_state.updated_at`: an answer is reused while that stamp is the one it was computed
at. A dashboard polled by several users, or a page that asks twice, reads the rollups once
per pass. Reused answers are shared, so their arrays are made read-only.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import sqlalchemy as sa

from stepscope.store import reads

P = ParamSpec("P")
R = TypeVar("R")

MAX_ANSWERS = 32
"""Answers kept per query function (a 1,024 × 1,000 heatmap is 4 MB)."""


def per_pass(
    fn: Callable[Concatenate[sa.Engine, str, P], R],
) -> Callable[Concatenate[sa.Engine, str, P], R]:
    """`fn(engine, job_id, ...)`, reused while the job's last analyzer pass is the same."""
    answers: OrderedDict[tuple[Any, ...], R] = OrderedDict()
    lock = threading.Lock()

    @functools.wraps(fn)
    def reuse(engine: sa.Engine, job_id: str, *args: P.args, **kwargs: P.kwargs) -> R:
        version = reads.analysis_version(engine, job_id)
        if version is None:
            return fn(engine, job_id, *args, **kwargs)
        key = (engine.url.render_as_string(), job_id, version, args, tuple(sorted(kwargs.items())))
        with lock:
            if key in answers:
                answers.move_to_end(key)
                return answers[key]
        answer = fn(engine, job_id, *args, **kwargs)
        _read_only(answer)
        with lock:
            answers[key] = answer
            while len(answers) > MAX_ANSWERS:
                answers.popitem(last=False)
        return answer

    return reuse


def _read_only(answer: Any) -> None:
    """Make the numpy arrays of a dataclass answer (and of its dict fields) read-only."""
    if not dataclasses.is_dataclass(answer):
        return
    for f in dataclasses.fields(answer):
        value = getattr(answer, f.name)
        for array in value.values() if isinstance(value, dict) else (value,):
            if isinstance(array, np.ndarray):
                array.setflags(write=False)
