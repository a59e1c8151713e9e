"""What a dashboard request works with, kept on its Flask app: the engine, and where
deep-capture requests go (#21) with who may make them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import flask
import sqlalchemy as sa

from stepscope.dashboard.signin import COOKIE

if TYPE_CHECKING:
    from stepscope.pipeline.captures import CaptureDesk

_KEY = "stepscope"
_CAPTURES_KEY = "stepscope.captures"
REQUEST_SCOPES = frozenset({"ingest", "admin"})
"""A token that may ask for a deep capture holds one of these."""


@dataclass(frozen=True, slots=True)
class Captures:
    desk: CaptureDesk
    auth: bool
    token_scopes: Callable[[str], frozenset[str] | None]


def attach(server: flask.Flask, engine: sa.Engine) -> None:
    """Keep the engine on the Flask app of a dashboard."""
    server.extensions[_KEY] = engine


def attach_captures(server: flask.Flask, captures: Captures) -> None:
    """Keep the server's capture desk (and how to check a token) on the Flask app."""
    server.extensions[_CAPTURES_KEY] = captures


def engine() -> sa.Engine:
    """The engine of the dashboard serving the current request."""
    found: sa.Engine = flask.current_app.extensions[_KEY]
    return found


def capture_desk() -> CaptureDesk | None:
    """The desk taking capture requests; None when the dashboard has none (no server)."""
    captures: Captures | None = flask.current_app.extensions.get(_CAPTURES_KEY)
    return None if captures is None else captures.desk


def may_request_captures() -> bool:
    """The current request may ask for a deep capture: auth is off, or its token (bearer
    header, else the sign-in cookie) holds the ingest or admin scope."""
    captures: Captures | None = flask.current_app.extensions.get(_CAPTURES_KEY)
    if captures is None:
        return False
    if not captures.auth:
        return True
    kind, _, token = flask.request.headers.get("Authorization", "").partition(" ")
    token = token.strip() if kind.lower() == "bearer" else ""
    token = token or flask.request.cookies.get(COOKIE, "")
    scopes = captures.token_scopes(token) if token else None
    return bool(scopes and scopes & REQUEST_SCOPES)
