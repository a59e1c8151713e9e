"""503 with Retry-After, never 500, while the database is unavailable (down, restarting,
refusing connections, locked); logged once per outage, not once per request."""

from __future__ import annotations

import sqlite3

import psycopg
import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from stepscope.store.availability import OUTAGES, is_unavailable

DATABASE_ERRORS: tuple[type[Exception], ...] = (
    sa.exc.DBAPIError,
    sa.exc.TimeoutError,
    sqlite3.Error,
    psycopg.Error,  # the writer's COPY path talks to the driver directly
)


def unavailable_response(retry_after_s: int) -> JSONResponse:
    """The 503 a client retries: it says why and when."""
    detail = f"the database is unavailable for now; retry in {retry_after_s} s"
    return JSONResponse(
        {"detail": detail}, status_code=503, headers={"Retry-After": str(retry_after_s)}
    )


def install(app: FastAPI, *, retry_after_s: int) -> None:
    """Answer database outages with 503 + Retry-After; other database errors stay 500s."""

    async def handler(_request: Request, exc: Exception) -> JSONResponse:
        if not is_unavailable(exc):
            raise exc
        OUTAGES.unavailable(exc)
        return unavailable_response(retry_after_s)

    for error in DATABASE_ERRORS:
        app.add_exception_handler(error, handler)
