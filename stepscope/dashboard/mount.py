"""The dashboard inside the FastAPI app: one route that claims only the dashboard's paths.

Dash runs on its Flask server, bridged with a2wsgi: each request (a page, a callback)
runs in a worker thread, so a slow callback never blocks the event loop that serves
ingest. The route matches the dashboard's own paths only (no catch-all), so it shadows
no API route, whatever is added after it. Responses are gzip-compressed here; with auth
on, nothing but the sign-in page is served without a read token.
"""

from __future__ import annotations

from typing import Any

import dash
from a2wsgi import WSGIMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse
from starlette.routing import BaseRoute, Match, NoMatchFound
from starlette.types import ASGIApp, Receive, Scope, Send

from stepscope.dashboard import signin

RESERVED = ("/api", "/v1", "/docs", "/redoc", "/openapi.json", "/healthz", "/metrics")
"""Paths the dashboard never claims (the API, the collector, docs, health, metrics)."""
PAGE_PREFIXES = ("/jobs",)
INTERNAL_PREFIXES = ("/_dash-", "/_reload-hash", "/_favicon.ico", "/assets/")
"""Dash's own routes: layout, dependencies, callbacks, component bundles, assets."""
GZIP_LEVEL = 5
"""Level 6 takes ~2.3× the CPU for ~6% fewer bytes on a job page (its heatmap), and level 9
~3× for ~3% fewer on plotly.js."""
WSGI_WORKERS = 16
"""Threads running Dash requests (a page fires several callbacks at once)."""


def is_reserved(path: str) -> bool:
    """True for a path the dashboard must leave to the rest of the app."""
    return any(path == p or path.startswith(p + "/") for p in RESERVED)


def is_page(path: str) -> bool:
    """True for a path of a dashboard page (the jobs list, a job, a rank, compare, …)."""
    if is_reserved(path):
        return False
    if any(path == p or path.startswith(p + "/") for p in PAGE_PREFIXES):
        return True
    return path in {page["path"] for page in dash.page_registry.values()}


def is_internal(path: str) -> bool:
    """True for one of Dash's own request paths."""
    return path.startswith(INTERNAL_PREFIXES)


class DashboardRoute(BaseRoute):
    """Serves the dashboard's pages, Dash's requests and sign-in; matches nothing else."""

    def __init__(self, flask_app: Any, *, auth: bool, token_scopes: signin.TokenScopes) -> None:
        self._dash: ASGIApp = GZipMiddleware(
            WSGIMiddleware(flask_app, workers=WSGI_WORKERS),  # type: ignore[arg-type]
            compresslevel=GZIP_LEVEL,
        )
        self._auth = auth
        self._token_scopes = token_scopes

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        """FULL for the dashboard's paths, NONE for every other."""
        if scope["type"] != "http":
            return Match.NONE, {}
        path = scope["path"]
        claimed = path in (signin.SIGN_IN, signin.SIGN_OUT) or is_internal(path) or is_page(path)
        return (Match.FULL, {}) if claimed else (Match.NONE, {})

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        """The dashboard has no named routes."""
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Sign-in, the auth gate, then Dash."""
        path = scope["path"]
        if path in (signin.SIGN_IN, signin.SIGN_OUT):
            request = Request(scope, receive)
            if path == signin.SIGN_OUT:
                response = signin.sign_out(request)
            else:
                response = await signin.sign_in(request, self._token_scopes, auth=self._auth)
            await response(scope, receive, send)
            return
        if self._auth:
            request = Request(scope)
            if not await signin.token_allows(self._token_scopes, signin.presented_token(request)):
                await self._refuse(request)(scope, receive, send)
                return
        await self._dash(scope, receive, send)

    @staticmethod
    def _refuse(request: Request) -> JSONResponse | RedirectResponse:
        """A page request goes to the sign-in page; anything else gets a 401 without data."""
        path = request.url.path
        if request.method == "GET" and is_page(path):
            query = f"?{request.url.query}" if request.url.query else ""
            return RedirectResponse(signin.sign_in_url(path + query), status_code=303)
        return JSONResponse(
            {"detail": f"sign in at {signin.SIGN_IN}, or send a read token as a bearer header"},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
