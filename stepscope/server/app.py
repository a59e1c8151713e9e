"""The one ASGI app: collector, REST API, webhooks and health, sharing one engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from stepscope import __version__
from stepscope.api import errors
from stepscope.api.routes import router as api_router
from stepscope.collector.captures import routes as capture_routes
from stepscope.collector.hangs import route as hangs_route
from stepscope.collector.ingest import route as ingest_route
from stepscope.collector.otlp import RankDirectory
from stepscope.collector.otlp import route as otlp_route
from stepscope.pipeline.captures import CaptureDesk
from stepscope.pipeline.hang_monitor import HangMonitor
from stepscope.pipeline.job_pass import FindingsHook
from stepscope.pipeline.resources import PassResources
from stepscope.pipeline.scheduler import BackgroundAnalyzer
from stepscope.schema import Finding
from stepscope.server import unavailable
from stepscope.server.auth import Authorizer, TokenCache
from stepscope.server.metrics import RequestMetrics, build_metrics
from stepscope.server.metrics import route as metrics_route
from stepscope.server.openapi import build_openapi
from stepscope.server.settings import Settings
from stepscope.server.webhooks import WebhookSender
from stepscope.store.availability import OUTAGES
from stepscope.store.engine import is_sqlite, make_engine, ping
from stepscope.store.migrate import ensure_current
from stepscope.store.writer import BatchWriter

if TYPE_CHECKING:
    from stepscope.server.otlp_export import OtlpEventExporter


def otlp_exporter(engine: sa.Engine, settings: Settings) -> OtlpEventExporter | None:
    """The OTLP log export of findings and summaries, when an endpoint is set."""
    if not settings.otlp_export_endpoint:
        return None
    # Imported here: the OpenTelemetry SDK loads only when the export is on.
    from stepscope.server.otlp_export import OtlpEventExporter

    return OtlpEventExporter(
        engine,
        settings.otlp_export_endpoint,
        interval_s=settings.otlp_export_interval_s,
        seen_within_s=settings.active_within_s,
        timeout_s=settings.otlp_export_timeout_s,
    )


def fan_out(*hooks: FindingsHook | None) -> FindingsHook | None:
    """One findings hook that tells each of `hooks` (each never raises), or None."""
    present = [hook for hook in hooks if hook is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def tell_all(job_id: str, findings: list[Finding]) -> None:
        for hook in present:
            hook(job_id, findings)

    return tell_all


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the embedded SQLite database is migrated on start."""
    settings = settings or Settings()
    engine = make_engine(
        settings.database_url, sqlite_busy_timeout_s=settings.sqlite_busy_timeout_s
    )
    ensure_current(engine, auto_upgrade=is_sqlite(engine))
    metrics = build_metrics(engine, seen_within_s=settings.active_within_s)
    webhooks = (
        WebhookSender(
            engine,
            settings.webhook_urls,
            secret=settings.webhook_secret.get_secret_value() if settings.webhook_secret else None,
            timeout_s=settings.webhook_timeout_s,
            max_attempts=settings.webhook_max_attempts,
            on_attempt=metrics.webhook_attempt,
        )
        if settings.webhook_urls
        else None
    )
    exporter = otlp_exporter(engine, settings)
    webhook_hook = webhooks.offer if webhooks else None
    desk = CaptureDesk(
        engine,
        num_steps=settings.capture_steps,
        max_steps=settings.capture_request_max_steps,
        auto=settings.capture_auto,
        max_auto_per_job=settings.capture_max_auto_per_job,
    )
    desk.refresh()
    on_findings = fan_out(
        webhook_hook, exporter.pass_findings if exporter else None, desk.on_findings
    )
    resources = PassResources()  # shared by the background passes and POST .../analyze
    analyzer = BackgroundAnalyzer(
        engine,
        interval_s=settings.analyze_interval_s,
        active_within_s=settings.active_within_s,
        grace_s=settings.rollup_grace_s,
        resources=resources,
        on_findings=on_findings,
        on_pass=metrics.analyzer_pass,
    )
    writer = BatchWriter(engine)
    hang_monitor = HangMonitor(
        engine,
        silent_after_s=settings.hang_silent_after_s,
        debounce_s=settings.hang_debounce_s,
        on_findings=fan_out(webhook_hook, exporter.offered if exporter else None, desk.on_findings),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if webhooks:
            webhooks.start()
        if exporter:
            exporter.start()
        analyzer.start()
        try:
            yield
        finally:
            analyzer.stop()
            resources.close()
            if webhooks:
                webhooks.stop()
            if exporter:
                exporter.stop()
            writer.close()
            hang_monitor.close()
            engine.dispose()

    app = FastAPI(
        title="stepscope",
        version=__version__,
        description="Performance observability for distributed training: the collector "
        "(/v1/ingest) and the query API (/api/v1).",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.writer = writer
    app.state.hang_monitor = hang_monitor
    app.state.captures = desk
    app.state.metrics = metrics
    app.state.otlp_ranks = RankDirectory(engine, seen_within_s=settings.active_within_s)
    app.state.pass_resources = resources
    tokens = TokenCache(engine)
    app.state.authorize = Authorizer(tokens, auth=settings.auth)
    app.state.on_findings = on_findings
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Content-Encoding"],
        )
    app.add_middleware(RequestMetrics, metrics=metrics)
    errors.install(app)
    unavailable.install(app, retry_after_s=settings.retry_after_s)
    app.router.routes.append(metrics_route)
    app.router.routes.append(ingest_route)
    app.router.routes.append(otlp_route)
    app.router.routes.append(hangs_route)
    app.router.routes.extend(capture_routes)
    app.include_router(api_router)
    app.openapi = lambda: build_openapi(app)  # type: ignore[method-assign]

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        ping(engine)  # unavailable: 503 (stepscope.server.unavailable)
        OUTAGES.available()
        return {"status": "ok", "database": engine.dialect.name}

    from stepscope.dashboard import mount_dashboard

    mount_dashboard(
        app,
        engine,
        auth=settings.auth,
        token_scopes=tokens.scopes,
        retry_after_s=settings.retry_after_s,
        capture_desk=desk,
    )
    return app
