"""The web dashboard (DESIGN §6): Dash pages over stepscope.query, served by the one app."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlalchemy as sa
    from fastapi import FastAPI

    from stepscope.pipeline.captures import CaptureDesk


def mount_dashboard(
    app: FastAPI,
    engine: sa.Engine,
    *,
    auth: bool,
    token_scopes: Callable[[str], frozenset[str] | None],
    retry_after_s: int = 5,
    capture_desk: CaptureDesk | None = None,
) -> None:
    """Serve the dashboard at `/` of `app` (its own paths only; with auth, behind sign-in).

    `token_scopes` gives a bearer token's scopes (None for an unknown token); while the
    database is unavailable, pages and callbacks answer 503 with `retry_after_s`. With
    `capture_desk`, the job page asks for deep captures (tokens with ingest or admin).
    """
    from stepscope.dashboard.app import build_dash
    from stepscope.dashboard.context import Captures
    from stepscope.dashboard.mount import DashboardRoute

    captures = (
        Captures(desk=capture_desk, auth=auth, token_scopes=token_scopes)
        if capture_desk is not None
        else None
    )
    dash_app = build_dash(engine, auth=auth, retry_after_s=retry_after_s, captures=captures)
    app.router.routes.append(DashboardRoute(dash_app.server, auth=auth, token_scopes=token_scopes))
