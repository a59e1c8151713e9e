"""The one ASGI app: collector, REST API and health, sharing one engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import sqlalchemy as sa
from fastapi import FastAPI

from stepscope import __version__
from stepscope.api.analyzer import BackgroundAnalyzer
from stepscope.api.auth import TokenCache
from stepscope.api.settings import Settings
from stepscope.collector.ingest import route as ingest_route
from stepscope.store.engine import is_sqlite, make_engine
from stepscope.store.migrate import ensure_current
from stepscope.store.writer import BatchWriter


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the embedded SQLite database is migrated on start."""
    settings = settings or Settings()
    engine = make_engine(settings.database_url)
    ensure_current(engine, auto_upgrade=is_sqlite(engine))
    analyzer = BackgroundAnalyzer(
        engine,
        interval_s=settings.analyze_interval_s,
        active_within_s=settings.active_within_s,
        grace_s=settings.rollup_grace_s,
    )
    writer = BatchWriter(engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        analyzer.start()
        try:
            yield
        finally:
            analyzer.stop()
            writer.close()
            engine.dispose()

    app = FastAPI(title="stepscope", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.writer = writer
    app.state.tokens = TokenCache(engine)
    app.router.routes.append(ingest_route)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return {"status": "ok", "database": engine.dialect.name}

    return app
