"""`GET /metrics`: the server's own health and each live job's key gauges, for Prometheus.

Labels stay bounded: per outcome, reason, route template or job, never per rank or step.
"""

from __future__ import annotations

import math
import time
from typing import Any

import sqlalchemy as sa
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stepscope.store import jobs

INGEST_PATHS = frozenset({"/v1/ingest", "/v1/metrics", "/v1/hangs"})
"""Routes whose rejected requests count as rejected batches."""
_REASONS = {
    400: "invalid",
    401: "unauthorized",
    403: "forbidden",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid",
}
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def rejection_reason(status_code: int) -> str:
    """A bounded label for why a batch was refused."""
    return _REASONS.get(status_code, "other")


class ServerMetrics:
    """The server's counters and histograms, in a registry of its own (one per app)."""

    def __init__(self, engine: sa.Engine, *, seen_within_s: float) -> None:
        self._engine = engine
        self._seen_within_s = seen_within_s
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ingest_batches = Counter(
            "stepscope_ingest_batches",
            "Ingest batches by outcome (accepted, duplicate, rejected, failed)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.ingest_rows = Counter(
            "stepscope_ingest_rows",
            "Rows stored by ingest, per table (gpu, steps, metrics, ...)",
            ["table"],
            registry=r,
        )
        self.rejected_batches = Counter(
            "stepscope_ingest_rejected_batches",
            "Ingest requests refused, by reason",
            ["endpoint", "reason"],
            registry=r,
        )
        self.otlp_points = Counter(
            "stepscope_otlp_points",
            "OTLP data points received, by where they went (gpu, metrics, unplaced, rejected)",
            ["outcome"],
            registry=r,
        )
        self.request_duration = Histogram(
            "stepscope_http_request_duration_seconds",
            "HTTP request latency by route template, method and status class",
            ["route", "method", "status"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.analyzer_passes = Counter(
            "stepscope_analyzer_passes",
            "Background analysis passes over a job, by outcome",
            ["outcome"],
            registry=r,
        )
        self.analyzer_duration = Histogram(
            "stepscope_analyzer_pass_duration_seconds",
            "Duration of one job's background analysis pass",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        self.database_errors = Counter(
            "stepscope_database_errors",
            "Database errors, by where they surfaced (request, analyzer)",
            ["source"],
            registry=r,
        )
        self.webhook_deliveries = Counter(
            "stepscope_webhook_deliveries",
            "Webhook delivery attempts, by outcome (delivered, retrying, given_up)",
            ["outcome"],
            registry=r,
        )

    def exposition(self) -> bytes:
        """The server's series and each live job's gauges, in the Prometheus text format."""
        rows = jobs.live_job_figures(self._engine, seen_within_s=self._seen_within_s)
        return generate_latest(self.registry) + live_jobs_text(rows).encode()

    def batch_stored(
        self, endpoint: str, rows_by_table: dict[str, int], *, duplicate: bool
    ) -> None:
        """Count one stored (or already stored) batch and its new rows."""
        self.ingest_batches.labels(endpoint, "duplicate" if duplicate else "accepted").inc()
        if duplicate:
            return
        for table, num_rows in rows_by_table.items():
            if num_rows:
                self.ingest_rows.labels(table).inc(num_rows)

    def batch_rejected(self, endpoint: str, status_code: int) -> None:
        """Count one refused batch (a 4xx request, or a bundle's batch rejected alone)."""
        self.rejected_batches.labels(endpoint, rejection_reason(status_code)).inc()
        self.ingest_batches.labels(endpoint, "rejected").inc()

    def otlp_received(self, outcomes: dict[str, int]) -> None:
        """Count OTLP points by where they went."""
        for outcome, num_points in outcomes.items():
            if num_points:
                self.otlp_points.labels(outcome).inc(num_points)

    def analyzer_pass(self, duration_s: float, error: BaseException | None) -> None:
        """Count one job's pass (the BackgroundAnalyzer's hook)."""
        self.analyzer_passes.labels("failed" if error else "ok").inc()
        self.analyzer_duration.observe(duration_s)
        if isinstance(error, sa.exc.SQLAlchemyError):
            self.database_errors.labels("analyzer").inc()

    def webhook_attempt(self, outcome: str) -> None:
        """Count one webhook delivery attempt (the WebhookSender's hook)."""
        self.webhook_deliveries.labels(outcome).inc()


_JOB_GAUGES = (
    ("step_p50_s", "stepscope_job_step_p50_seconds", "Median step time (steady state)"),
    ("tokens_per_s", "stepscope_job_tokens_per_second", "Tokens per second, whole job"),
    ("mfu", "stepscope_job_mfu_ratio", "Model FLOPs utilisation (0-1)"),
    ("goodput", "stepscope_job_goodput_ratio", "Productive share of the job's GPU-time (0-1)"),
)
SEVERITIES = ("info", "warning", "critical")


def _label(value: str) -> str:
    """A label value escaped for the text format."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    value = float(value)
    if math.isfinite(value):
        return repr(value)
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


def live_jobs_text(rows: list[dict[str, Any]]) -> str:
    """Each live job's gauges in the Prometheus text format.

    Written directly: prometheus_client's exposition costs ~0.3 ms a job, and a scrape of
    1,000 live jobs must stay well under 100 ms.
    """
    out = [
        "# HELP stepscope_live_jobs Jobs that sent data recently",
        "# TYPE stepscope_live_jobs gauge",
        f"stepscope_live_jobs {_number(len(rows))}",
    ]
    labels = [f'job_id="{_label(row["job_id"])}"' for row in rows]
    for column, name, doc in _JOB_GAUGES:
        out += [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
        out += [
            f"{name}{{{label}}} {_number(row[column])}"
            for label, row in zip(labels, rows, strict=True)
            if row[column] is not None
        ]
    out += [
        "# HELP stepscope_job_findings Findings by severity",
        "# TYPE stepscope_job_findings gauge",
    ]
    for label, row in zip(labels, rows, strict=True):
        out += [
            f'stepscope_job_findings{{{label},severity="{severity}"}} '
            f"{_number(row[f'num_{severity}'])}"
            for severity in SEVERITIES
            if row[f"num_{severity}"] is not None
        ]
    out += [
        "# HELP stepscope_job_hang 1 while the job has an open hang finding",
        "# TYPE stepscope_job_hang gauge",
    ]
    out += [
        f"stepscope_job_hang{{{label}}} {1.0 if row['hang'] else 0.0}"
        for label, row in zip(labels, rows, strict=True)
    ]
    return "\n".join(out) + "\n"


class RequestMetrics:
    """ASGI middleware: each request's latency by route template; refused ingest by reason;
    database errors that escape a handler."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics
        # The routes hit most often match without a scan of every route.
        self._static = frozenset({*INGEST_PATHS, "/metrics", "/healthz"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception as exc:
            if isinstance(exc, sa.exc.SQLAlchemyError):
                self.metrics.database_errors.labels("request").inc()
            status[0] = 500
            raise
        finally:
            self._observe(scope, status[0], time.perf_counter() - start)

    def _template(self, scope: Scope) -> str:
        """The path template of the route that served the request (bounded cardinality)."""
        path = scope["path"]
        if path in self._static:
            return path
        for route in scope["app"].router.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return str(getattr(route, "path", "") or "/")
        return "unmatched"

    def _observe(self, scope: Scope, status_code: int, elapsed_s: float) -> None:
        template = self._template(scope)
        self.metrics.request_duration.labels(
            template, scope["method"], f"{status_code // 100}xx"
        ).observe(elapsed_s)
        if template in INGEST_PATHS and scope["method"] == "POST":
            if 400 <= status_code < 500:
                self.metrics.batch_rejected(template, status_code)
            elif status_code >= 500:
                self.metrics.ingest_batches.labels(template, "failed").inc()


async def _metrics(request: Request) -> Response:
    request.app.state.authorize(request, "read")
    metrics: ServerMetrics = request.app.state.metrics
    body = await run_in_threadpool(metrics.exposition)  # the live jobs' query
    return Response(body, media_type=CONTENT_TYPE_LATEST)


route = Route("/metrics", _metrics, methods=["GET"], include_in_schema=False)


def build_metrics(engine: sa.Engine, *, seen_within_s: float) -> ServerMetrics:
    """The server's metrics, with the live jobs of `engine` (seen within `seen_within_s`)."""
    disable_created_metrics()  # the *_created series double a scrape and say little
    return ServerMetrics(engine, seen_within_s=seen_within_s)
