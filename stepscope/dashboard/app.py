"""The Dash app: its Flask server, pages and callbacks, reading one engine."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import dash
import flask
import sqlalchemy as sa

from stepscope.dashboard import components, context, live
from stepscope.dashboard.pages import PAGE_MODULES

ASSETS = Path(__file__).with_name("assets")


def build_dash(engine: sa.Engine, *, auth: bool) -> dash.Dash:
    """A Dash app on its own Flask server, with every page and callback registered."""
    server = flask.Flask(__name__)
    context.attach(server, engine)
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
    return app


def _page(name: str) -> ModuleType:
    """A page module, imported now that an app exists (its import registers the page)."""
    return importlib.import_module(name)
