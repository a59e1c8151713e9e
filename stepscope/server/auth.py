"""Bearer-token authentication with scopes ingest, read and admin, for every server route.

The server puts an `Authorizer` on `app.state.authorize`; the collector, the REST API and the
dashboard ask it for a scope per request, without importing this module.
"""

from __future__ import annotations

import threading
import time

import sqlalchemy as sa
from fastapi import HTTPException, Request, status

from stepscope.schema import Scope
from stepscope.store import tokens

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


class Authorizer:
    """Admits a request whose token has a scope (admin has all); every request with auth off."""

    def __init__(self, tokens: TokenCache, *, auth: bool) -> None:
        self.tokens = tokens
        self.auth = auth

    def __call__(self, request: Request, scope: Scope) -> None:
        """Raise 401 without a known bearer token, 403 when it lacks `scope`."""
        if not self.auth:
            return
        header = request.headers.get("authorization", "")
        kind, _, token = header.partition(" ")
        if kind.lower() != "bearer" or not token.strip():
            raise _unauthorized("missing bearer token")
        scopes = self.tokens.scopes(token.strip())
        if scopes is None:
            raise _unauthorized("unknown token")
        if scope not in scopes and "admin" not in scopes:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"token lacks the {scope!r} scope")
