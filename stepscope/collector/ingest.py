"""`POST /v1/ingest`: the native batch endpoint of the wire protocol (DESIGN §3)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from stepscope.api.auth import IngestAuth
from stepscope.collector.validate import BatchError, decode_body, parse_batch
from stepscope.store.writer import BatchWriter

log = logging.getLogger(__name__)
router = APIRouter()


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


def ingest_body(
    writer: BatchWriter, body: bytes, content_encoding: str | None, max_bytes: int
) -> dict[str, Any]:
    """Decode, validate and store one batch; the response document."""
    batch = parse_batch(decode_body(body, content_encoding=content_encoding, max_bytes=max_bytes))
    result = writer.write(
        job=batch.job, source=batch.source, seq=batch.seq, sections=batch.sections
    )
    return {"accepted": result.accepted, "duplicate": result.duplicate}


@router.post("/v1/ingest", tags=["collector"])
async def ingest(request: Request, _auth: IngestAuth) -> dict[str, Any]:
    """Store one rank's batch of records, whole or not at all."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise HTTPException(415, f"Content-Type must be application/json, got {content_type!r}")
    settings = request.app.state.settings
    body = await read_body_limited(request, settings.max_body_bytes)
    try:
        return await run_in_threadpool(
            ingest_body,
            request.app.state.writer,
            body,
            request.headers.get("content-encoding"),
            settings.max_body_bytes,
        )
    except BatchError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
