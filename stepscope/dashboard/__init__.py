"""The web dashboard (DESIGN §6): Dash pages over stepscope.query, served by the one app."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlalchemy as sa
    from fastapi import FastAPI

    from stepscope.server.settings import Settings


def mount_dashboard(app: FastAPI, engine: sa.Engine, settings: Settings) -> None:
    """Serve the dashboard at `/` of `app` (its own paths only; with auth, behind sign-in)."""
    from stepscope.dashboard.app import build_dash
    from stepscope.dashboard.mount import DashboardRoute

    dash_app = build_dash(engine, settings)
    app.router.routes.append(
        DashboardRoute(dash_app.server, auth=settings.auth, tokens=lambda: app.state.tokens)
    )
