"""Reading stored jobs from a server (REST API) or straight from a database, alike.

Both readers return the API's response models, so the CLI prints the same thing whichever
it reads from; a StoreReader builds them with the same query functions the routes call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

import httpx
import sqlalchemy as sa
from pydantic import TypeAdapter

from stepscope import __version__, query
from stepscope.api.schemas import FindingRead, JobsPage, JobSummaryRead


class ReadError(Exception):
    """What went wrong reading, said for a user (unknown job, bad filter, unreachable server)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobsRequest:
    """The filters, order and page of a jobs list (the parameters of GET /api/v1/jobs)."""

    status: tuple[str, ...] = ()
    benchmark_key: str | None = None
    name: str | None = None
    min_severity: str | None = None
    sort: str = "-started_at"
    cursor: str | None = None
    limit: int = 50


class Reader(Protocol):
    def jobs(self, request: JobsRequest) -> JobsPage: ...

    def summary(self, job_id: str) -> JobSummaryRead: ...

    def findings(self, job_id: str) -> list[FindingRead]: ...

    def export(self, job_id: str, table: str, format: str) -> Iterator[bytes]: ...

    def close(self) -> None: ...


_FINDINGS = TypeAdapter(list[FindingRead])


class HttpReader:
    """Reads through a stepscope server's REST API."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 60.0) -> None:
        headers = {"User-Agent": f"stepscope/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._url = url.rstrip("/")
        self._client = httpx.Client(
            base_url=f"{self._url}/api/v1", headers=headers, timeout=timeout_s
        )

    def jobs(self, request: JobsRequest) -> JobsPage:
        params: dict[str, Any] = {"sort": request.sort, "limit": request.limit}
        params["status"] = list(request.status)
        for name in ("benchmark_key", "name", "min_severity", "cursor"):
            if getattr(request, name) is not None:
                params[name] = getattr(request, name)
        return JobsPage.model_validate_json(self._get("/jobs", params))

    def summary(self, job_id: str) -> JobSummaryRead:
        return JobSummaryRead.model_validate_json(self._get(f"/jobs/{_quoted(job_id)}"))

    def findings(self, job_id: str) -> list[FindingRead]:
        return _FINDINGS.validate_json(self._get(f"/jobs/{_quoted(job_id)}/findings"))

    def export(self, job_id: str, table: str, format: str) -> Iterator[bytes]:
        path = f"/jobs/{_quoted(job_id)}/export"
        params = {"table": table, "format": format}
        request = self._client.build_request("GET", path, params=params)
        try:
            response = self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise ReadError(f"cannot reach {self._url}: {exc}") from None
        if not response.is_success:
            response.read()
            response.close()
            raise ReadError(_error_text(response))
        return _streamed(response)

    def close(self) -> None:
        self._client.close()

    def _get(self, path: str, params: dict[str, Any] | None = None) -> bytes:
        try:
            response = self._client.get(path, params=params)
        except httpx.HTTPError as exc:
            raise ReadError(f"cannot reach {self._url}: {exc}") from None
        if not response.is_success:
            raise ReadError(_error_text(response))
        return response.content


def _streamed(response: httpx.Response) -> Iterator[bytes]:
    try:
        yield from response.iter_bytes()
    finally:
        response.close()


def _quoted(job_id: str) -> str:
    return quote(job_id, safe="")


def _error_text(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = None
    if response.status_code == 401:
        hint = " (pass --token or set STEPSCOPE_TOKEN)"
    elif response.status_code == 403:
        hint = " (use a token with the read scope)"
    else:
        hint = ""
    return f"{detail or response.reason_phrase} [HTTP {response.status_code}]{hint}"


class StoreReader:
    """Reads a stepscope database in-process through stepscope.query."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine

    def jobs(self, request: JobsRequest) -> JobsPage:
        def read() -> JobsPage:
            filters = query.JobFilters(
                status=request.status,
                benchmark_key=request.benchmark_key,
                name_contains=request.name,
                min_severity=request.min_severity,
            )
            page = query.list_jobs(
                self._engine, filters, sort=request.sort, cursor=request.cursor, limit=request.limit
            )
            return JobsPage.of(page)

        return _guarded(read)

    def summary(self, job_id: str) -> JobSummaryRead:
        return _guarded(lambda: JobSummaryRead.of(query.job_summary(self._engine, job_id)))

    def findings(self, job_id: str) -> list[FindingRead]:
        return _guarded(lambda: [FindingRead.of(f) for f in query.findings(self._engine, job_id)])

    def export(self, job_id: str, table: str, format: str) -> Iterator[bytes]:
        return _guarded(lambda: query.export(self._engine, job_id, table, format))

    def close(self) -> None:
        self._engine.dispose()


T = TypeVar("T")


def _guarded(read: Callable[[], T]) -> T:
    try:
        return read()
    except (query.JobNotFound, ValueError) as exc:
        raise ReadError(str(exc)) from None


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (None for another engine or an in-memory database)."""
    parsed = sa.make_url(url)
    if not parsed.drivername.startswith("sqlite") or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def findings_json(findings: list[FindingRead]) -> str:
    """Findings as indented JSON, for --format json."""
    return _FINDINGS.dump_json(findings, indent=2).decode()
