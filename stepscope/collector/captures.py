"""`POST /v1/captures/{id}`: a rank's deep-capture trace (#21), and `.../failure`: why it
gave up. A trace is gzipped Chrome/Perfetto JSON (torch.profiler's export), validated and
summarised whole before it is stored; a bad one is refused with a 4xx naming the problem."""

from __future__ import annotations

import gzip
import time
from typing import Any

import orjson
from fastapi import HTTPException, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.routing import Route

from stepscope.analysis.captures.traces import summarize_trace
from stepscope.collector.ingest import read_body_limited
from stepscope.collector.validate import BatchError, decode_body, inflate
from stepscope.store import captures

MAX_ERROR_CHARS = 1024
_STEP_PARAMETERS = ("first_step", "last_step")


def _capture_id(request: Request) -> int:
    text = request.path_params["capture_id"]
    if not text.isdigit() or len(text) > 10 or int(text) > captures.MAX_CAPTURE_ID:
        raise HTTPException(404, f"no capture {text[:40]!r}")
    return int(text)


def _steps(request: Request) -> dict[str, int | None]:
    steps: dict[str, int | None] = {}
    for name in _STEP_PARAMETERS:
        text = request.query_params.get(name)
        if text is None:
            steps[name] = None
            continue
        if not text.isdigit() or len(text) > 18:
            raise HTTPException(422, f"{name} must be a non-negative integer, got {text[:40]!r}")
        steps[name] = int(text)
    first, last = steps["first_step"], steps["last_step"]
    if first is not None and last is not None and last < first:
        raise HTTPException(422, f"last_step ({last}) is before first_step ({first})")
    return steps


def parse_trace(body: bytes, *, content_encoding: str | None, max_bytes: int) -> dict[str, Any]:
    """The trace's JSON object; BatchError naming what is wrong."""
    text = inflate(body, content_encoding=content_encoding, max_bytes=max_bytes)
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise BatchError(f"trace is not valid JSON: {exc}", status=400) from exc
    if not isinstance(doc, dict):
        raise BatchError("trace must be a JSON object with traceEvents (Chrome trace format)")
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        raise BatchError("trace.traceEvents must be a list (Chrome trace format)")
    if not any(isinstance(e, dict) and e.get("ph") == "X" for e in events):
        raise BatchError("trace.traceEvents has no complete events (ph 'X'): nothing recorded")
    return doc


def _store_trace(
    request: Request, capture_id: int, trace_gz: bytes, summary: dict[str, Any], steps: dict
) -> None:
    with request.app.state.engine.begin() as conn:
        status = captures.capture_status(conn, capture_id)
        if status is None:
            raise HTTPException(404, f"no capture {capture_id}")
        if status == "uploaded":
            raise HTTPException(409, f"capture {capture_id} already has its trace")
        captures.save_trace(
            conn, capture_id, trace_gz=trace_gz, summary=summary, at=time.time(), **steps
        )


async def upload(request: Request) -> Response:
    """Store a rank's trace and its summary with the capture, whole or not at all."""
    request.app.state.authorize(request, "ingest")
    capture_id = _capture_id(request)
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise HTTPException(415, f"Content-Type must be application/json, got {content_type!r}")
    settings = request.app.state.settings
    steps = _steps(request)
    body = await read_body_limited(request, settings.capture_max_bytes)
    encoding = request.headers.get("content-encoding")
    try:
        doc = await run_in_threadpool(
            parse_trace,
            body,
            content_encoding=encoding,
            max_bytes=settings.capture_max_inflated_bytes,
        )
    except BatchError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    summary = await run_in_threadpool(summarize_trace, doc)
    is_gzip = (encoding or "").strip().lower() == "gzip"
    trace_gz = body if is_gzip else await run_in_threadpool(gzip.compress, body, 6)
    await run_in_threadpool(_store_trace, request, capture_id, trace_gz, summary, steps)
    request.app.state.metrics.batch_stored("/v1/captures", {"captures": 1}, duplicate=False)
    reply = {"ok": True, "num_operators": len(summary["operators"])}
    return Response(orjson.dumps(reply), media_type="application/json")


def _store_failure(request: Request, capture_id: int, error: str) -> None:
    with request.app.state.engine.begin() as conn:
        if captures.capture_status(conn, capture_id) is None:
            raise HTTPException(404, f"no capture {capture_id}")
        captures.save_failure(conn, capture_id, error=error, at=time.time())


async def failure(request: Request) -> Response:
    """Store why a rank gave up its capture: {"error": "..."}."""
    request.app.state.authorize(request, "ingest")
    capture_id = _capture_id(request)
    body = await read_body_limited(request, 64 * 1024)
    try:
        doc = decode_body(
            body, content_encoding=request.headers.get("content-encoding"), max_bytes=64 * 1024
        )
    except BatchError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, str) or not error.strip() or "\x00" in error:
        raise HTTPException(422, "error must be a non-empty string without NUL")
    await run_in_threadpool(_store_failure, request, capture_id, error[:MAX_ERROR_CHARS])
    return Response(orjson.dumps({"ok": True}), media_type="application/json")


routes = [
    Route("/v1/captures/{capture_id}", upload, methods=["POST"], include_in_schema=False),
    Route("/v1/captures/{capture_id}/failure", failure, methods=["POST"], include_in_schema=False),
]
