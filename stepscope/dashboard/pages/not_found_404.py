"""What any unknown dashboard path shows (Dash Pages' 404 page by module name)."""

from __future__ import annotations

import dash
from dash import html

from stepscope.dashboard.components import message


def layout(**_query: str) -> html.Div:
    """No such page."""
    return message("No such page", "The address matches no dashboard page.", kind="error")


def register_callbacks(_app: dash.Dash) -> None:
    """None: the page is static."""


dash.register_page(__name__, path="/404", title="Not found · stepscope", order=4, layout=layout)
