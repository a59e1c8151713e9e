"""The engine and settings a dashboard request reads, kept on its Flask app."""

from __future__ import annotations

from dataclasses import dataclass

import flask
import sqlalchemy as sa

from stepscope.server.settings import Settings

_KEY = "stepscope"


@dataclass(frozen=True, slots=True)
class Context:
    engine: sa.Engine
    settings: Settings


def attach(server: flask.Flask, engine: sa.Engine, settings: Settings) -> None:
    """Keep the engine and settings on the Flask app of a dashboard."""
    server.extensions[_KEY] = Context(engine=engine, settings=settings)


def engine() -> sa.Engine:
    """The engine of the dashboard serving the current request."""
    context: Context = flask.current_app.extensions[_KEY]
    return context.engine


def settings() -> Settings:
    """The settings of the dashboard serving the current request."""
    context: Context = flask.current_app.extensions[_KEY]
    return context.settings
