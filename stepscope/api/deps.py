"""Request dependencies of the API routes, as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

import sqlalchemy as sa
from fastapi import Depends, Path, Request

from stepscope.collector.validate import MAX_ID_CHARS
from stepscope.pipeline.job_pass import FindingsHook
from stepscope.query import JobNotFound
from stepscope.server.settings import Settings

MAX_STEP = 2**53
"""Largest step number a request may name (steps are stored as 64-bit integers)."""
MAX_RANK = 2**31 - 1
NO_NUL = r"^[^\x00]*$"
"""Text parameters cannot hold NUL: no stored text can (PostgreSQL refuses it)."""


# async: a sync dependency costs a thread hop per request.
async def _engine(request: Request) -> sa.Engine:
    return request.app.state.engine


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


async def _findings_hook(request: Request) -> FindingsHook | None:
    return request.app.state.on_findings


async def _job_id(
    job_id: Annotated[str, Path(min_length=1, max_length=MAX_ID_CHARS, description="A job id")],
) -> str:
    if "\x00" in job_id:  # no job can have it; the database would refuse the lookup
        raise JobNotFound(job_id)
    return job_id


EngineDep = Annotated[sa.Engine, Depends(_engine)]
SettingsDep = Annotated[Settings, Depends(_settings)]
FindingsHookDep = Annotated[FindingsHook | None, Depends(_findings_hook)]
JobIdDep = Annotated[str, Depends(_job_id)]
