"""Deep captures (#21): ask a rank for a torch.profiler trace, list them, download one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from stepscope.api.capture_read import CaptureRequestRead, capture_requests
from stepscope.api.deps import MAX_RANK, EngineDep, IngestAuth, JobIdDep, ReadAuth
from stepscope.api.errors import ERROR_RESPONSES, JOB_RESPONSES
from stepscope.api.schemas import ErrorRead
from stepscope.pipeline.captures import BadCaptureRequest, CaptureDesk
from stepscope.query.captures import TraceNotFound, capture_trace
from stepscope.store.captures import MAX_CAPTURE_ID

router = APIRouter(tags=["captures"])


class CaptureCreate(BaseModel):
    """What to capture: the rank, optionally the reference rank and the number of steps."""

    model_config = ConfigDict(extra="forbid")
    rank: int = Field(ge=0, le=MAX_RANK)
    reference_rank: int | None = Field(default=None, ge=0, le=MAX_RANK)
    """Recorded beside it; default: the lowest other rank that sent a batch."""
    num_steps: int | None = Field(default=None, ge=1)
    """Default: the server's capture_steps."""


async def _desk(request: Request) -> CaptureDesk:
    return request.app.state.captures


DeskDep = Annotated[CaptureDesk, Depends(_desk)]


@router.post(
    "/jobs/{job_id}/captures",
    summary="Ask a rank for a deep capture",
    status_code=201,
    responses=JOB_RESPONSES,
)
def request_capture(
    engine: EngineDep, desk: DeskDep, job_id: JobIdDep, body: CaptureCreate, _auth: IngestAuth
) -> CaptureRequestRead:
    """Ask `rank` and a reference rank to record torch.profiler for `num_steps` steps
    (told in the answer to their next batch; scope ingest or admin); the request."""
    try:
        request_id = desk.request(
            job_id, rank=body.rank, reference_rank=body.reference_rank, num_steps=body.num_steps
        )
    except BadCaptureRequest as exc:
        raise RequestValidationError([{"loc": ("body", exc.field), "msg": str(exc)}]) from exc
    return next(r for r in capture_requests(engine, job_id) if r.id == request_id)


@router.get("/jobs/{job_id}/captures", summary="A job's deep captures", responses=JOB_RESPONSES)
def list_captures(engine: EngineDep, job_id: JobIdDep, _auth: ReadAuth) -> list[CaptureRequestRead]:
    """The job's capture requests, newest first, with each rank's top operators and the two
    ranks side by side."""
    return capture_requests(engine, job_id)


@router.get(
    "/captures/{capture_id}/trace",
    summary="Download a capture's trace",
    response_class=Response,
    responses={
        **ERROR_RESPONSES,
        200: {"content": {"application/gzip": {}}, "description": "Chrome/Perfetto JSON, gzip"},
        404: {"model": ErrorRead, "description": "No such capture, or no trace yet"},
    },
)
def download_trace(
    engine: EngineDep,
    capture_id: Annotated[int, Path(ge=1, le=MAX_CAPTURE_ID, description="A capture id")],
    _auth: ReadAuth,
) -> Response:
    """The rank's torch.profiler trace as uploaded: gzipped Chrome/Perfetto JSON (open it in
    https://ui.perfetto.dev or chrome://tracing)."""
    try:
        trace = capture_trace(engine, capture_id)
    except TraceNotFound as exc:
        return JSONResponse(ErrorRead(detail=str(exc)).model_dump(), status_code=404)
    return Response(
        trace.trace_gz,
        media_type="application/gzip",
        headers={"Content-Disposition": f'attachment; filename="{trace.filename}"'},
    )
