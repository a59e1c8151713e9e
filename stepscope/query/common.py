"""What every query shares: the unknown-job error, argument checks, the job lookup."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from stepscope.store import jobs


class JobNotFound(LookupError):
    """No job with this id is stored."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r} is stored")
        self.job_id = job_id


def require_job(engine: sa.Engine, job_id: str) -> dict[str, Any]:
    """The jobs row of `job_id`; raises JobNotFound if there is none."""
    job = jobs.load_job(engine, job_id)
    if job is None:
        raise JobNotFound(job_id)
    return job


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise ValueError naming the argument and its allowed values if `value` is not one."""
    options = tuple(allowed)
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(str, options))}; got {value!r}")


def check_at_least(name: str, value: int, minimum: int) -> None:
    """Raise ValueError naming the argument if `value` < `minimum`."""
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
