"""Stored jobs, read alike from a database (LocalStore) or a stepscope server (RemoteStore).

Both return the API's response models, so a command prints the same thing whichever it
reads; a LocalStore builds them with the same query functions the routes call. Both also
give the CI gate a job's step rollups and rank levels (JobData) and its history.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

import httpx
import polars as pl
import sqlalchemy as sa
from pydantic import TypeAdapter

from stepscope import __version__, query
from stepscope.analysis.regression.gate import JobData
from stepscope.api.capture_read import CaptureRequestRead, capture_requests
from stepscope.api.fleet_read import NodeDetailRead, NodesPage
from stepscope.api.goodput_read import FleetGoodputRead, GoodputRead, fleet_read, goodput_read
from stepscope.api.schemas import FindingRead, JobsPage, JobSummaryRead


class StoreError(Exception):
    """What went wrong opening or reading, said for a user (no database, outdated schema,
    unknown job, bad filter, unreachable server)."""


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


@dataclass(frozen=True, slots=True, kw_only=True)
class NodesRequest:
    """The filters and order of a nodes list (the parameters of GET /api/v1/nodes)."""

    suspect: bool = False
    name: str | None = None
    sort: str = "-effect"
    limit: int = 100


class JobStore(Protocol):
    """Stored jobs, from a database or a server; every method raises StoreError."""

    where: str
    """Where the jobs are, for messages (a database URL without its password, or a URL)."""

    def jobs(self, request: JobsRequest) -> JobsPage: ...

    def summary(self, job_id: str) -> JobSummaryRead: ...

    def findings(self, job_id: str) -> list[FindingRead]: ...

    def goodput(self, job_id: str) -> GoodputRead: ...

    def fleet_goodput(self, since: float, until: float | None) -> FleetGoodputRead:
        """Goodput over every job in [since, until) (until None: now)."""
        ...

    def export(self, job_id: str, table: str, format: str) -> Iterator[bytes]: ...

    def nodes(self, request: NodesRequest) -> NodesPage: ...

    def node(self, node: str) -> NodeDetailRead: ...

    def captures(self, job_id: str) -> list[CaptureRequestRead]: ...

    def capture_trace(self, capture_id: int) -> bytes:
        """A deep capture's trace, gzipped Chrome/Perfetto JSON, as uploaded."""
        ...

    def gate_data(self, job_id: str) -> JobData:
        """The job's step rollups and rank levels, as the CI gate compares them."""
        ...

    def history(
        self, benchmark_key: str, *, last: int, started_before: float | None, exclude: list[str]
    ) -> list[str]:
        """Ids of the last finished jobs of the key started before this time, newest first."""
        ...

    def close(self) -> None: ...


_FINDINGS = TypeAdapter(list[FindingRead])
_CAPTURES = TypeAdapter(list[CaptureRequestRead])
T = TypeVar("T")


class LocalStore:
    """A stepscope database, read in-process through stepscope.query."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.where = engine.url.render_as_string(hide_password=True)

    @classmethod
    def open(cls, database_url: str) -> LocalStore:
        """The database at this URL; StoreError if it is missing, unreadable or not at the
        latest migration (it is never upgraded here: `stepscope db upgrade` does that)."""
        from stepscope.store.engine import make_engine
        from stepscope.store.migrate import SchemaOutdatedError, ensure_current

        path = sqlite_path(database_url)
        if path is not None and not path.is_file():
            raise StoreError(
                f"no database at {path}: pass --db URL, or --url of a stepscope server"
            )
        store = cls(make_engine(database_url))
        try:
            ensure_current(store.engine, auto_upgrade=False)
        except SchemaOutdatedError as exc:
            store.close()
            raise StoreError(f"{store.where}: {exc}") from None
        except sa.exc.DBAPIError as exc:
            store.close()
            raise StoreError(f"cannot open {store.where}: {exc.orig}") from None
        return store

    def jobs(self, request: JobsRequest) -> JobsPage:
        def read() -> JobsPage:
            filters = query.JobFilters(
                status=request.status,
                benchmark_key=request.benchmark_key,
                name_contains=request.name,
                min_severity=request.min_severity,
            )
            page = query.list_jobs(
                self.engine, filters, sort=request.sort, cursor=request.cursor, limit=request.limit
            )
            return JobsPage.of(page)

        return _guarded(read)

    def summary(self, job_id: str) -> JobSummaryRead:
        return _guarded(lambda: JobSummaryRead.of(query.job_summary(self.engine, job_id)))

    def findings(self, job_id: str) -> list[FindingRead]:
        return _guarded(lambda: [FindingRead.of(f) for f in query.findings(self.engine, job_id)])

    def goodput(self, job_id: str) -> GoodputRead:
        from stepscope.query.goodput import job_goodput

        return _guarded(lambda: goodput_read(job_goodput(self.engine, job_id)))

    def fleet_goodput(self, since: float, until: float | None) -> FleetGoodputRead:
        from stepscope.query.goodput_fleet import fleet_goodput

        end = until if until is not None else time.time()
        return _guarded(lambda: fleet_read(fleet_goodput(self.engine, since=since, until=end)))

    def export(self, job_id: str, table: str, format: str) -> Iterator[bytes]:
        return _guarded(lambda: query.export(self.engine, job_id, table, format))

    def nodes(self, request: NodesRequest) -> NodesPage:
        from stepscope.query import fleet

        filters = fleet.NodeFilters(suspect=request.suspect, name_contains=request.name)
        return _guarded(
            lambda: NodesPage.of(
                fleet.list_nodes(self.engine, filters, sort=request.sort, limit=request.limit)
            )
        )

    def node(self, node: str) -> NodeDetailRead:
        from stepscope.query import fleet

        return _guarded(lambda: NodeDetailRead.of(fleet.node_detail(self.engine, node)))

    def gate_data(self, job_id: str) -> JobData:
        from stepscope.query import history

        started_at = self.summary(job_id).started_at
        rollup = history.gate_rollup(self.engine, job_id)
        if rollup.is_empty():
            raise StoreError(
                f"job {job_id!r} has no step rollups yet: run `stepscope analyze {job_id}` "
                "(or wait for the server's analyzer)"
            )
        ranks = history.rank_levels(self.engine, job_id)
        return JobData(
            job_id=job_id,
            rollup=rollup,
            ranks=ranks if not ranks.is_empty() else None,
            started_at=started_at,
        )

    def history(
        self, benchmark_key: str, *, last: int, started_before: float | None, exclude: list[str]
    ) -> list[str]:
        from stepscope.query import history

        rows = _guarded(
            lambda: history.comparable_jobs(
                self.engine,
                benchmark_key,
                last=last,
                started_before=started_before,
                exclude=exclude,
            )
        )
        return [r.job_id for r in rows]

    def captures(self, job_id: str) -> list[CaptureRequestRead]:
        return _guarded(lambda: capture_requests(self.engine, job_id))

    def capture_trace(self, capture_id: int) -> bytes:
        from stepscope.query.captures import TraceNotFound, capture_trace

        try:
            return capture_trace(self.engine, capture_id).trace_gz
        except TraceNotFound as exc:
            raise StoreError(str(exc)) from None

    def close(self) -> None:
        self.engine.dispose()


def _guarded(read: Callable[[], T]) -> T:
    from stepscope.query.fleet import NodeNotFound

    try:
        return read()
    except (query.JobNotFound, NodeNotFound, ValueError) as exc:
        raise StoreError(str(exc)) from None


API_MAX_POINTS = 10_000
"""Points the API returns per series: longer jobs are read in step ranges of this size."""
_API_SERIES = {
    "step_s_max": ("step_s", "max"),
    "data_s_max": ("data_s", "max"),
    "comm_wait_s_min": ("comm_wait_s", "min"),
    "num_ranks": ("num_ranks", None),
    "tokens_per_s": ("tokens_per_s", None),
    "mfu": ("mfu", None),
}
"""Step-rollup columns the gate reads ← the API series (metric, agg across ranks)."""


class RemoteStore:
    """The jobs of a stepscope server, read through its REST API (/api/v1)."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 60.0) -> None:
        headers = {"User-Agent": f"stepscope/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.where = url.rstrip("/")
        self._client = httpx.Client(
            base_url=f"{self.where}/api/v1", headers=headers, timeout=timeout_s
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

    def goodput(self, job_id: str) -> GoodputRead:
        return GoodputRead.model_validate_json(self._get(f"/jobs/{_quoted(job_id)}/goodput"))

    def fleet_goodput(self, since: float, until: float | None) -> FleetGoodputRead:
        body = self._get("/goodput", {"since": since, "until": until})
        return FleetGoodputRead.model_validate_json(body)

    def export(self, job_id: str, table: str, format: str) -> Iterator[bytes]:
        path = f"/jobs/{_quoted(job_id)}/export"
        params = {"table": table, "format": format}
        request = self._client.build_request("GET", path, params=params)
        try:
            response = self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise StoreError(f"cannot reach {self.where}: {exc}") from None
        if not response.is_success:
            response.read()
            response.close()
            raise StoreError(_error_text(response))
        return _streamed(response)

    def nodes(self, request: NodesRequest) -> NodesPage:
        params: dict[str, Any] = {"sort": request.sort, "limit": request.limit}
        params["suspect"] = request.suspect
        if request.name is not None:
            params["name"] = request.name
        return NodesPage.model_validate_json(self._get("/nodes", params))

    def node(self, node: str) -> NodeDetailRead:
        return NodeDetailRead.model_validate_json(self._get(f"/nodes/{_quoted(node)}"))

    def gate_data(self, job_id: str) -> JobData:
        info = self.summary(job_id)
        if not info.num_steps or info.first_step is None or info.last_step is None:
            raise StoreError(f"job {job_id!r} on {self.where} has no rolled-up steps yet")
        first, last = info.first_step, info.last_step
        frames = []
        for column, (metric, agg) in _API_SERIES.items():
            parts = [
                self._series(job_id, column, metric, agg, lo, min(last, lo + API_MAX_POINTS - 1))
                for lo in range(first, last + 1, API_MAX_POINTS)
            ]
            frames.append(pl.concat(parts))
        rollup = frames[0]
        for frame in frames[1:]:
            rollup = rollup.join(frame, on="step", how="left")
        rollup = rollup.with_columns(
            (pl.col("tokens_per_s") * pl.col("step_s_max")).alias("tokens"),
            pl.col("num_ranks").fill_null(0),
        )
        rows = self._json(f"/jobs/{_quoted(job_id)}/ranks").get("ranks", [])
        ranks = pl.DataFrame(
            {
                "rank": [r["rank"] for r in rows],
                "node": [r.get("node") for r in rows],
                "data_s": [r["median_s"].get("data_s") for r in rows],
                "compute_s": [r["median_s"].get("compute_s") for r in rows],
            },
            schema={
                "rank": pl.Int64,
                "node": pl.String,
                "data_s": pl.Float64,
                "compute_s": pl.Float64,
            },
        ).drop_nulls(["data_s", "compute_s"])
        return JobData(
            job_id=job_id,
            rollup=rollup.sort("step"),
            ranks=ranks if ranks.height else None,
            started_at=info.started_at,
        )

    def _series(
        self, job_id: str, column: str, metric: str, agg: str | None, lo: int, hi: int
    ) -> pl.DataFrame:
        """One step range of a series, whole (the range holds at most max_points steps)."""
        params = {"metric": metric, "agg": agg, "from_step": lo, "to_step": hi}
        doc = self._json(
            f"/jobs/{_quoted(job_id)}/timeseries", params | {"max_points": API_MAX_POINTS}
        )
        return pl.DataFrame(
            {"step": doc["step"], column: doc["value"]},
            schema={"step": pl.Int64, column: pl.Float64},
        )

    def history(
        self, benchmark_key: str, *, last: int, started_before: float | None, exclude: list[str]
    ) -> list[str]:
        params = {
            "benchmark_key": benchmark_key,
            "status": "finished",
            "sort": "-started_at",
            "limit": last + len(exclude),
            "started_before": started_before,
        }
        ids = [j["job_id"] for j in self._json("/jobs", params)["jobs"]]
        return [i for i in ids if i not in exclude][:last]

    def captures(self, job_id: str) -> list[CaptureRequestRead]:
        return _CAPTURES.validate_json(self._get(f"/jobs/{_quoted(job_id)}/captures"))

    def capture_trace(self, capture_id: int) -> bytes:
        return self._get(f"/captures/{capture_id}/trace")

    def request_capture(
        self, job_id: str, *, rank: int, reference_rank: int | None, num_steps: int | None
    ) -> CaptureRequestRead:
        """Ask the server for a deep capture of `rank` (the token needs ingest or admin)."""
        body = {"rank": rank, "reference_rank": reference_rank, "num_steps": num_steps}
        body = {k: v for k, v in body.items() if v is not None}
        try:
            response = self._client.post(f"/jobs/{_quoted(job_id)}/captures", json=body)
        except httpx.HTTPError as exc:
            raise StoreError(f"cannot reach {self.where}: {exc}") from None
        if not response.is_success:
            raise StoreError(_error_text(response))
        return CaptureRequestRead.model_validate_json(response.content)

    def close(self) -> None:
        self._client.close()

    def _json(self, path: str, params: dict[str, Any] | None = None) -> Any:
        return json.loads(self._get(path, params))

    def _get(self, path: str, params: dict[str, Any] | None = None) -> bytes:
        kept = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._client.get(path, params=kept)
        except httpx.HTTPError as exc:
            raise StoreError(f"cannot reach {self.where}: {exc}") from None
        if not response.is_success:
            raise StoreError(_error_text(response))
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
        hint = " (use a token with the scope it names)"
    else:
        hint = ""
    return f"{detail or response.reason_phrase} [HTTP {response.status_code}]{hint}"


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (None for another engine or an in-memory database)."""
    parsed = sa.make_url(url)
    if not parsed.drivername.startswith("sqlite") or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def findings_json(findings: list[FindingRead]) -> str:
    """Findings as indented JSON, for --format json."""
    return _FINDINGS.dump_json(findings, indent=2).decode()
