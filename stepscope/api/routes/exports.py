"""Streamed exports of a job's records in the canonical schema."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from stepscope import query
from stepscope.api.deps import EngineDep, JobIdDep, ReadAuth
from stepscope.api.errors import JOB_RESPONSES

if TYPE_CHECKING:
    ExportTable = str
    ExportFormat = str
else:
    ExportTable = Literal[query.EXPORT_TABLES]
    ExportFormat = Literal[query.EXPORT_FORMATS]

router = APIRouter(tags=["export"], responses=JOB_RESPONSES)

_BINARY = {"schema": {"type": "string", "format": "binary"}}


@router.get(
    "/jobs/{job_id}/export",
    summary="Export a job's records",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The rows, streamed",
            "content": dict.fromkeys(query.EXPORT_MEDIA_TYPES.values(), _BINARY),
        }
    },
)
def export(
    engine: EngineDep,
    job_id: JobIdDep,
    _auth: ReadAuth,
    table: ExportTable = "steps",
    format: Annotated[ExportFormat, Query(description="parquet (snappy), csv or ndjson")] = (
        "parquet"
    ),
) -> StreamingResponse:
    """The job's rows of `table` with the canonical columns, streamed batch by batch, so the
    server's memory does not grow with the job."""
    chunks = query.export(engine, job_id, table, format)  # checks the job before streaming
    return StreamingResponse(
        chunks,
        media_type=query.EXPORT_MEDIA_TYPES[format],
        headers={"Content-Disposition": _attachment(f"{job_id}-{table}.{format}")},
    )


def _attachment(filename: str) -> str:
    """A Content-Disposition naming the file (RFC 6266: ASCII fallback and UTF-8 name)."""
    fallback = re.sub(r"[^A-Za-z0-9._-]", "_", filename)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"
