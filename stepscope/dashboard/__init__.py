"""The web dashboard (DESIGN §6): Dash pages over stepscope.query, served by the one app."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlalchemy as sa
    from fastapi import FastAPI


def mount_dashboard(
    app: FastAPI,
    engine: sa.Engine,
    *,
    auth: bool,
    token_scopes: Callable[[str], frozenset[str] | None],
    retry_after_s: int = 5,
) -> None:
    """Serve the dashboard at `/` of `app` (its own paths only; with auth, behind sign-in).

    `token_scopes` gives a bearer token's scopes (None for an unknown token); while the
    database is unavailable, pages and callbacks answer 503 with `retry_after_s`.
    """
    from stepscope.dashboard.app import build_dash
    from stepscope.dashboard.mount import DashboardRoute

    dash_app = build_dash(engine, auth=auth, retry_after_s=retry_after_s)
    app.router.routes.append(DashboardRoute(dash_app.server, auth=auth, token_scopes=token_scopes))
