"""The Dash app: its Flask server, pages and callbacks, reading one engine."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import dash
import flask
import sqlalchemy as sa

from stepscope.dashboard import captures as capture_panel
from stepscope.dashboard import components, context, live
from stepscope.dashboard.pages import PAGE_MODULES
from stepscope.store.availability import OUTAGES, is_unavailable

ASSETS = Path(__file__).with_name("assets")


def build_dash(
    engine: sa.Engine,
    *,
    auth: bool,
    retry_after_s: int = 5,
    captures: context.Captures | None = None,
) -> dash.Dash:
    """A Dash app on its own Flask server, with every page and callback registered."""
    server = flask.Flask(__name__)
    context.attach(server, engine)
    if captures is not None:
        context.attach_captures(server, captures)
    _answer_outages(server, retry_after_s)
    app = dash.Dash(
        __name__,
        server=server,  # type: ignore[arg-type]
        use_pages=True,
        pages_folder="",
        assets_folder=str(ASSETS),
        title="stepscope",
        update_title=None,  # type: ignore[arg-type]
        suppress_callback_exceptions=True,
        compress=False,  # the ASGI route compresses (stepscope.dashboard.mount)
        include_pages_meta=False,
    )
    pages = [_page(name) for name in PAGE_MODULES]
    app.layout = components.shell(auth=auth)
    for module in pages:
        module.register_callbacks(app)
    live.register_callbacks(app)
    capture_panel.register_callbacks(app)
    return app


def _answer_outages(server: flask.Flask, retry_after_s: int) -> None:
    """503 with Retry-After, not a 500 and a traceback, while the database is unavailable."""

    def unavailable(exc: Exception) -> flask.Response:
        if not is_unavailable(exc):
            raise exc
        OUTAGES.unavailable(exc)
        return flask.Response(
            f"The database is unavailable for now; retry in {retry_after_s} s.",
            status=503,
            headers={"Retry-After": str(retry_after_s)},
            mimetype="text/plain",
        )

    for error in (sa.exc.DBAPIError, sa.exc.TimeoutError):
        server.register_error_handler(error, unavailable)


def _page(name: str) -> ModuleType:
    """A page module, imported now that an app exists (its import registers the page)."""
    return importlib.import_module(name)
