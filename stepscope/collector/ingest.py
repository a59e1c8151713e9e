"""`POST /v1/ingest`: the native batch endpoint of the wire protocol (DESIGN §3)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from fastapi import HTTPException, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.routing import Route

from stepscope.collector.validate import Batch, BatchError, decode_body, parse_document
from stepscope.pipeline.captures import CaptureDesk
from stepscope.store.captures import Pending
from stepscope.store.writer import BatchWriter, WriteResult

log = logging.getLogger(__name__)


async def read_body_limited(request: Request, max_bytes: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPException(413, f"body of {declared} bytes exceeds the limit of {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HTTPException(413, f"body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


_INLINE_BODY_BYTES = 256 * 1024


def parse_body(
    body: bytes, content_encoding: str | None, max_bytes: int
) -> Batch | list[Batch | BatchError]:
    return parse_document(decode_body(body, content_encoding=content_encoding, max_bytes=max_bytes))


async def ingest(request: Request) -> Response:
    """Store one rank's batch of records, whole or not at all; or a node's bundle of batches,
    each stored whole or rejected alone, answered with one result per batch, in order.

    A plain Starlette endpoint: FastAPI's per-request dependency and response machinery
    costs about a quarter of the time of a small batch.
    """
    request.app.state.authorize(request, "ingest")
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise HTTPException(415, f"Content-Type must be application/json, got {content_type!r}")
    settings = request.app.state.settings
    body = await read_body_limited(request, settings.max_body_bytes)
    encoding = request.headers.get("content-encoding")
    try:
        # Small bodies parse faster than a thread hop; large ones must not stall the loop.
        if len(body) <= _INLINE_BODY_BYTES:
            parsed = parse_body(body, encoding, settings.max_body_bytes)
        else:
            parsed = await run_in_threadpool(parse_body, body, encoding, settings.max_body_bytes)
    except BatchError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    if isinstance(parsed, Batch):
        (answer,) = await _store(request, [parsed])
        return Response(orjson.dumps(answer), media_type="application/json")
    stored = iter(await _store(request, [b for b in parsed if isinstance(b, Batch)]))
    results = [
        {"status": 200, **next(stored)} if isinstance(item, Batch) else _rejected(request, item)
        for item in parsed
    ]
    return Response(orjson.dumps({"results": results}), media_type="application/json")


async def _store(request: Request, batches: list[Batch]) -> list[dict[str, Any]]:
    """Write batches; the answer for each (rows accepted, resend or not, a capture order)."""
    if not batches:
        return []
    writer: BatchWriter = request.app.state.writer
    written = writer.submit(
        [{"job": b.job, "source": b.source, "seq": b.seq, "sections": b.sections} for b in batches]
    )
    results: list[WriteResult] = await asyncio.wrap_future(written)
    answers = []
    for batch, result in zip(batches, results, strict=True):
        request.app.state.metrics.batch_stored(
            "/v1/ingest", result.accepted, duplicate=result.duplicate
        )
        answer: dict[str, Any] = {"accepted": result.accepted, "duplicate": result.duplicate}
        capture = await _capture_for(request, batch)
        if capture is not None:
            answer["capture"] = capture
        answers.append(answer)
    return answers


def _rejected(request: Request, error: BatchError) -> dict[str, Any]:
    """A bundle's batch that was rejected alone, counted as a rejected request would be."""
    request.app.state.metrics.batch_rejected("/v1/ingest", error.status)
    return {"status": error.status, "detail": str(error)}


async def _capture_for(request: Request, batch: Batch) -> dict[str, Any] | None:
    """The rank's deep capture not yet told (#21), marked delivered; None nearly always."""
    desk: CaptureDesk = request.app.state.captures
    if desk.refresh_due():
        await run_in_threadpool(desk.refresh)
    pending = desk.take(batch.job["job_id"], batch.source["rank"])
    if pending is None:
        return None
    try:
        claimed = await run_in_threadpool(desk.claim, pending)
    except Exception:  # the batch is stored: answer it, and tell the rank with a later one
        log.warning("could not claim capture %d", pending.capture_id, exc_info=True)
        desk.hold(pending)
        return None
    if not claimed:  # another replica told it
        return None
    return capture_instruction(pending, request.app.state.settings.capture_max_bytes)


def capture_instruction(pending: Pending, max_bytes: int) -> dict[str, Any]:
    """What the ingest answer tells a rank: record `num_steps` steps, POST the trace to
    `upload` (at most `max_bytes` gzipped)."""
    return {
        "id": pending.capture_id,
        "num_steps": pending.num_steps,
        "upload": f"/v1/captures/{pending.capture_id}",
        "max_bytes": max_bytes,
    }


route = Route("/v1/ingest", ingest, methods=["POST"], include_in_schema=False)
