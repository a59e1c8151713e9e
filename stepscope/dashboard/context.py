"""The engine a dashboard request reads, kept on its Flask app."""

from __future__ import annotations

import flask
import sqlalchemy as sa

_KEY = "stepscope"


def attach(server: flask.Flask, engine: sa.Engine) -> None:
    """Keep the engine on the Flask app of a dashboard."""
    server.extensions[_KEY] = engine


def engine() -> sa.Engine:
    """The engine of the dashboard serving the current request."""
    found: sa.Engine = flask.current_app.extensions[_KEY]
    return found
