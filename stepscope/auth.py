"""Bearer-token authentication with scopes ingest, read and admin."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Annotated

import sqlalchemy as sa
from fastapi import Depends, HTTPException, Request, status

from stepscope.store import queries

SCOPES = ("ingest", "read", "admin")
_CACHE_TTL_S = 30.0


class TokenCache:
    """Token → scopes, cached briefly so ingest does not hit the database per request."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._entries: dict[str, tuple[float, frozenset[str] | None]] = {}
        self._lock = threading.Lock()

    def scopes(self, token: str) -> frozenset[str] | None:
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(token)
        if hit and now - hit[0] < _CACHE_TTL_S:
            return hit[1]
        found = queries.token_scopes(self._engine, token)
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[token] = (now, found)
        return found


def require_scope(scope: str) -> Callable[[Request], Awaitable[None]]:
    """A dependency that admits a request holding a token with `scope` (or admin)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}")

    # async so FastAPI runs it on the event loop: a sync dependency costs a thread hop per
    # request, and the token cache answers without I/O nearly always.
    async def check(request: Request) -> None:
        if not request.app.state.settings.auth:
            return
        header = request.headers.get("authorization", "")
        kind, _, token = header.partition(" ")
        if kind.lower() != "bearer" or not token:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "missing bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scopes = request.app.state.tokens.scopes(token.strip())
        if scopes is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "unknown token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if scope not in scopes and "admin" not in scopes:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"token lacks the {scope!r} scope")

    return check


IngestAuth = Annotated[None, Depends(require_scope("ingest"))]
ReadAuth = Annotated[None, Depends(require_scope("read"))]
