"""Bearer-token authentication with scopes ingest, read and admin, for every server route.

The collector and the REST API both import this module (neither imports the other). The
app keeps its settings in `app.state.settings` and a TokenCache in `app.state.tokens`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Annotated

import sqlalchemy as sa
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from stepscope.store import tokens

SCOPES = ("ingest", "read", "admin")
_CACHE_TTL_S = 30.0


class TokenCache:
    """Token → scopes, cached briefly so ingest does not hit the database per request."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._entries: dict[str, tuple[float, frozenset[str] | None]] = {}
        self._lock = threading.Lock()

    def scopes(self, token: str) -> frozenset[str] | None:
        """The scopes of a valid token; None for an unknown or revoked one."""
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(token)
        if hit and now - hit[0] < _CACHE_TTL_S:
            return hit[1]
        found = tokens.token_scopes(self._engine, token)
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[token] = (now, found)
        return found


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": "Bearer"}
    )


def authorize(request: Request, scope: str) -> None:
    """Raise 401 without a known bearer token, 403 when it lacks `scope` (admin has all)."""
    if not request.app.state.settings.auth:
        return
    header = request.headers.get("authorization", "")
    kind, _, token = header.partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        raise _unauthorized("missing bearer token")
    scopes = request.app.state.tokens.scopes(token.strip())
    if scopes is None:
        raise _unauthorized("unknown token")
    if scope not in scopes and "admin" not in scopes:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"token lacks the {scope!r} scope")


def require_scope(scope: str) -> Callable[[Request], Awaitable[None]]:
    """An awaitable check admitting a request whose token has `scope` (or admin)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}")

    # async so FastAPI runs it on the event loop: a sync dependency costs a thread hop per
    # request, and the token cache answers without I/O nearly always.
    async def check(request: Request) -> None:
        authorize(request, scope)

    return check


# Declares the bearer scheme in the OpenAPI document ("Authorize" in /docs); the check
# itself reads the header, so that a missing token is a 401 whether auth is on or off.
_bearer = HTTPBearer(auto_error=False, description="A token from `stepscope token create`")


def _dependency(scope: str) -> Callable[..., Awaitable[None]]:
    check = require_scope(scope)

    async def dependency(
        request: Request,
        _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        await check(request)

    return dependency


IngestAuth = Annotated[None, Depends(_dependency("ingest"))]
ReadAuth = Annotated[None, Depends(_dependency("read"))]
AdminAuth = Annotated[None, Depends(_dependency("admin"))]
READ = Depends(_dependency("read"))
"""Router-level dependency: every route of the router needs the read scope."""
