"""`POST /v1/hangs`: a rank's hang report or heartbeat (#19), or a list of them (a node's
ranks), validated whole, stored as each rank's latest and attributed at once
(stepscope.pipeline.hang_monitor)."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import orjson
from fastapi import HTTPException, Request
from starlette.responses import Response
from starlette.routing import Route

from stepscope import schema
from stepscope.collector.ingest import read_body_limited
from stepscope.collector.validate import BatchError, decode_body

MAX_REPORTS = 1024
"""Reports in one request (a node's ranks sent together); the body limit still applies."""
MAX_FRONTIERS = 64
MAX_STACK_FRAMES = 256
MAX_TEXT_CHARS = 1024
KINDS = ("heartbeat", "hang")
STACK_SOURCES = ("watchdog", "faulthandler")

Fields = dict[str, tuple[tuple[type, ...], bool]]
"""Field name → (accepted types, required)."""
_INT: tuple[type, ...] = (int,)
_FLOAT: tuple[type, ...] = (int, float)
_STR: tuple[type, ...] = (str,)
_TOP: Fields = {
    "schema": (_INT, True),
    "job_id": (_STR, True),
    "rank": (_INT, True),
    "incarnation": (_STR, False),
    "node": (_STR, False),
    "pid": (_INT, False),
    "world_size": (_INT, False),
    "ts": (_FLOAT, True),
    "kind": (_STR, True),
    "step": (_INT, False),
    "section": (_STR, False),
    "phase": (_STR, False),
    "last_progress_ts": (_FLOAT, False),
    "stalled_s": (_FLOAT, False),
    "blocked": ((dict,), False),
    "frontiers": ((list,), False),
    "stack": ((list,), False),
    "stack_source": (_STR, False),
}
_BLOCKED: Fields = {
    "group": (_STR, True),
    "op": (_STR, True),
    "seq": (_INT, True),
    "since_ts": (_FLOAT, False),
    "bytes": (_INT, False),
}
_FRONTIER: Fields = {
    "group": (_STR, True),
    "mesh_dim": (_STR, False),
    "group_ranks": (_STR, False),
    "size": (_INT, False),
    "enqueued": (_INT, True),
    "completed": (_INT, True),
}
_FRAME: Fields = {"file": (_STR, True), "line": (_INT, True), "function": (_STR, True)}
_NON_NEGATIVE = {"rank", "pid", "world_size", "step", "stalled_s", "seq", "size", "line"}


def _check(where: str, obj: Any, fields: Fields) -> None:
    if not isinstance(obj, dict):
        raise BatchError(f"{where or 'report'} must be an object")
    unknown = set(obj) - set(fields)
    if unknown:
        raise BatchError(f"{where or 'report'} has unknown field(s): {', '.join(sorted(unknown))}")
    for name, (types, required) in fields.items():
        value = obj.get(name)
        path = f"{where}.{name}" if where else name
        if value is None:
            if required:
                raise BatchError(f"{path} is required")
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            raise BatchError(
                f"{path} must be of type {types[-1].__name__}, got {type(value).__name__}"
            )
        if isinstance(value, str) and (len(value) > MAX_TEXT_CHARS or "\x00" in value):
            raise BatchError(f"{path} must be at most {MAX_TEXT_CHARS} characters, without NUL")
        if isinstance(value, float) and not math.isfinite(value):
            raise BatchError(f"{path} must be a finite number")
        if name in _NON_NEGATIVE and isinstance(value, int | float) and value < 0:
            raise BatchError(f"{path} must not be negative")
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise BatchError(f"{path} is out of the 64-bit range")


def parse_report(doc: Any, *, received_at: float) -> dict[str, Any]:
    """A validated report as a hang_reports row; BatchError naming the first bad field."""
    _check("", doc, _TOP)
    if doc["schema"] != schema.WIRE_SCHEMA_VERSION:
        raise BatchError(f"schema must be {schema.WIRE_SCHEMA_VERSION}, got {doc['schema']!r}")
    if not doc["job_id"].strip() or len(doc["job_id"]) > schema.MAX_ID_CHARS:
        raise BatchError(f"job_id must be 1 to {schema.MAX_ID_CHARS} characters")
    if doc["kind"] not in KINDS:
        raise BatchError(f"kind must be one of {', '.join(KINDS)}, got {doc['kind']!r}")
    if doc.get("stack_source") is not None and doc["stack_source"] not in STACK_SOURCES:
        raise BatchError(f"stack_source must be one of {', '.join(STACK_SOURCES)}")
    blocked = doc.get("blocked")
    if blocked is not None:
        _check("blocked", blocked, _BLOCKED)
        if blocked["op"] not in schema.COLLECTIVE_OPS:
            raise BatchError(f"blocked.op has unknown op {blocked['op']!r}")
    frontiers = doc.get("frontiers") or []
    if len(frontiers) > MAX_FRONTIERS:
        raise BatchError(f"frontiers has more than {MAX_FRONTIERS} groups", status=413)
    for i, frontier in enumerate(frontiers):
        _check(f"frontiers[{i}]", frontier, _FRONTIER)
        ranks = frontier.get("group_ranks")
        if ranks is not None and not ranks.startswith("h:"):
            try:
                schema.expand_ranks(ranks)
            except ValueError as exc:
                raise BatchError(
                    f"frontiers[{i}].group_ranks is not compact ranks: {ranks!r}"
                ) from exc
    stack = doc.get("stack")
    if stack is not None:
        if len(stack) > MAX_STACK_FRAMES:
            raise BatchError(f"stack has more than {MAX_STACK_FRAMES} frames", status=413)
        for i, frame in enumerate(stack):
            _check(f"stack[{i}]", frame, _FRAME)
    floats = ("ts", "last_progress_ts", "stalled_s")
    row = {k: (float(v) if k in floats and v is not None else v) for k, v in doc.items()}
    row.pop("schema")
    row["frontiers"] = frontiers
    row["received_at"] = received_at
    return row


def parse_reports(doc: Any, *, received_at: float) -> list[dict[str, Any]]:
    """One report, or a list of them (a node's ranks at once), validated whole: BatchError
    naming the first bad report and field, and then none is stored."""
    if not isinstance(doc, list):
        return [parse_report(doc, received_at=received_at)]
    if not doc:
        raise BatchError("the list of reports is empty")
    if len(doc) > MAX_REPORTS:
        raise BatchError(f"more than {MAX_REPORTS} reports in one request", status=413)
    rows = []
    for i, one in enumerate(doc):
        try:
            rows.append(parse_report(one, received_at=received_at))
        except BatchError as exc:
            raise BatchError(f"reports[{i}]: {exc}", status=exc.status) from exc
    return rows


async def hangs(request: Request) -> Response:
    """Store ranks' reports as their latest and attribute the job's hang soon after."""
    request.app.state.authorize(request, "ingest")
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise HTTPException(415, f"Content-Type must be application/json, got {content_type!r}")
    max_bytes = request.app.state.settings.max_body_bytes
    body = await read_body_limited(request, max_bytes)
    try:
        doc = decode_body(
            body, content_encoding=request.headers.get("content-encoding"), max_bytes=max_bytes
        )
        rows = parse_reports(doc, received_at=time.time())
    except BatchError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    await asyncio.wrap_future(request.app.state.hang_monitor.submit(rows))
    request.app.state.metrics.batch_stored(
        "/v1/hangs", {"hang_reports": len(rows)}, duplicate=False
    )
    return Response(orjson.dumps({"ok": True}), media_type="application/json")


route = Route("/v1/hangs", hangs, methods=["POST"], include_in_schema=False)
