"""Request dependencies of the API routes, as Annotated aliases."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

import sqlalchemy as sa
from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from stepscope.pipeline.job_pass import FindingsHook
from stepscope.pipeline.resources import PassResources
from stepscope.query import JobNotFound
from stepscope.schema import MAX_ID_CHARS, Scope

MAX_STEP = 2**53
"""Largest step number a request may name (steps are stored as 64-bit integers)."""
MAX_RANK = 2**31 - 1
NO_NUL = r"^[^\x00]*$"
"""Text parameters cannot hold NUL: no stored text can (PostgreSQL refuses it)."""


# async: a sync dependency costs a thread hop per request.
async def _engine(request: Request) -> sa.Engine:
    return request.app.state.engine


async def _rollup_grace_s(request: Request) -> float:
    return float(request.app.state.settings.rollup_grace_s)


async def _findings_hook(request: Request) -> FindingsHook | None:
    return request.app.state.on_findings


async def _pass_resources(request: Request) -> PassResources:
    return request.app.state.pass_resources


async def _job_id(
    job_id: Annotated[str, Path(min_length=1, max_length=MAX_ID_CHARS, description="A job id")],
) -> str:
    if "\x00" in job_id:  # no job can have it; the database would refuse the lookup
        raise JobNotFound(job_id)
    return job_id


EngineDep = Annotated[sa.Engine, Depends(_engine)]
RollupGraceDep = Annotated[float, Depends(_rollup_grace_s)]
FindingsHookDep = Annotated[FindingsHook | None, Depends(_findings_hook)]
PassResourcesDep = Annotated[PassResources, Depends(_pass_resources)]
JobIdDep = Annotated[str, Depends(_job_id)]


# Declares the bearer scheme in the OpenAPI document ("Authorize" in /docs); the check itself
# (the server's `app.state.authorize`) reads the header, so a missing token is a 401.
_bearer = HTTPBearer(auto_error=False, description="A token from `stepscope token create`")


def _requires(scope: Scope) -> Callable[..., Awaitable[None]]:
    # async so FastAPI runs it on the event loop: the token cache answers without I/O nearly
    # always, and a sync dependency costs a thread hop per request.
    async def dependency(
        request: Request,
        _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        request.app.state.authorize(request, scope)

    return dependency


IngestAuth = Annotated[None, Depends(_requires("ingest"))]
ReadAuth = Annotated[None, Depends(_requires("read"))]
AdminAuth = Annotated[None, Depends(_requires("admin"))]
