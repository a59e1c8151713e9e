"""Errors as JSON: 404 for an unknown job, 422 naming each bad parameter, 409 for conflicts."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.dependencies.utils import get_flat_params
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from stepscope.api.schemas import ErrorRead, ParameterError, ValidationErrorRead
from stepscope.pipeline.job_pass import JobBusyError, RawRowsPrunedError
from stepscope.query import JobNotFound
from stepscope.query.fleet import NodeNotFound

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorRead, "description": "No or unknown bearer token (auth on)"},
    403: {"model": ErrorRead, "description": "The token lacks the route's scope"},
    422: {"model": ValidationErrorRead, "description": "A parameter is wrong (named)"},
    503: {
        "model": ErrorRead,
        "description": "The database is unavailable for now; retry after Retry-After seconds",
    },
}
JOB_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    404: {"model": ErrorRead, "description": "No such job"},
}
NODE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    404: {"model": ErrorRead, "description": "No job stored a level of this node"},
}
BUSY_RETRY_AFTER_S = 10
"""Retry-After of a 503 for a job whose analysis runs elsewhere, in seconds."""
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_INPUT_CHARS = 60


def install(app: FastAPI) -> None:
    """Register the API's exception handlers on `app`."""
    app.add_exception_handler(JobNotFound, _job_not_found)  # type: ignore[arg-type]
    app.add_exception_handler(NodeNotFound, _node_not_found)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid_request)  # type: ignore[arg-type]
    app.add_exception_handler(ValueError, _bad_argument)  # type: ignore[arg-type]
    app.add_exception_handler(RawRowsPrunedError, _pruned)  # type: ignore[arg-type]
    app.add_exception_handler(JobBusyError, _busy)  # type: ignore[arg-type]


async def _job_not_found(_request: Request, exc: JobNotFound) -> JSONResponse:
    return JSONResponse(ErrorRead(detail=str(exc)).model_dump(), status_code=404)


async def _node_not_found(_request: Request, exc: NodeNotFound) -> JSONResponse:
    return JSONResponse(ErrorRead(detail=str(exc)).model_dump(), status_code=404)


async def _pruned(_request: Request, exc: RawRowsPrunedError) -> JSONResponse:
    return JSONResponse(ErrorRead(detail=str(exc)).model_dump(), status_code=409)


async def _busy(_request: Request, exc: JobBusyError) -> JSONResponse:
    body = ErrorRead(detail=str(exc)).model_dump()
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})


def _unprocessable(errors: list[ParameterError]) -> JSONResponse:
    detail = "; ".join(e.message for e in errors)
    body = ValidationErrorRead(detail=detail, errors=errors)
    return JSONResponse(body.model_dump(), status_code=422)


async def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ())]
        parameter = loc[1] if len(loc) > 1 else (loc[0] if loc else "request")
        where = parameter + "".join(f"[{part}]" for part in loc[2:])  # e.g. status[1]
        message = f"{where}: {error.get('msg', 'invalid')}"
        given = error.get("input")
        if isinstance(given, str | int | float) and len(repr(given)) <= _MAX_INPUT_CHARS:
            message += f" (got {given!r})"
        errors.append(ParameterError(parameter=parameter, message=message))
    return _unprocessable(errors)


async def _bad_argument(request: Request, exc: ValueError) -> JSONResponse:
    """A query function's ValueError, which names the argument: a 422 for that parameter.
    One that names no parameter of the route is a fault of the server, not of the request."""
    names = _route_parameters(request)
    message = str(exc)
    parameter = next((w for w in _WORD.findall(message) if w in names), None)
    if parameter is None:
        raise exc
    return _unprocessable([ParameterError(parameter=parameter, message=message)])


def _route_parameters(request: Request) -> set[str]:
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return set(request.query_params)
    return {p.alias for p in get_flat_params(dependant)}
