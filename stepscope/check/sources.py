"""Where the gate's jobs come from: a database (--db), a server's REST API (--url), files.

Each source gives the same JobData (stepscope.analysis.regression): a stored job's step
rollups and rank table, or a file's canonical steps rolled up by the same analysis code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import polars as pl

from stepscope.analysis.regression import JobData, job_from_steps


class SourceError(Exception):
    """An error the user can fix (a wrong id, path or URL); the CLI prints it and exits 2."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo:
    job_id: str
    name: str | None
    benchmark_key: str | None
    status: str
    started_at: float | None
    world_size: int | None


class JobSource(Protocol):
    """Stored jobs, from a database or a server."""

    where: str
    """Where the jobs are, for messages."""

    def info(self, job_id: str) -> JobInfo: ...

    def data(self, job_id: str) -> JobData: ...

    def history(
        self, benchmark_key: str, *, last: int, started_before: float | None, exclude: list[str]
    ) -> list[str]:
        """Ids of the last finished jobs of the key, newest first."""
        ...


class DbSource:
    """Jobs in a database, read through stepscope.query."""

    def __init__(self, url: str) -> None:
        import sqlalchemy as sa

        from stepscope.store.engine import make_engine
        from stepscope.store.migrate import current_revision, head_revision

        if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
            raise SourceError(f"no database at {url}: give --db URL (or --url of a server)")
        self.where = _redacted(url)
        self.engine = make_engine(url)
        try:
            revision = current_revision(self.engine)
        except sa.exc.OperationalError as exc:
            raise SourceError(f"cannot open {self.where}: {exc.orig}") from None
        if revision != head_revision():
            raise SourceError(
                f"{self.where} is at schema {revision!r}, not {head_revision()!r}: "
                "run `stepscope db upgrade --db URL`"
            )

    def info(self, job_id: str) -> JobInfo:
        from stepscope import query

        try:
            s = query.job_summary(self.engine, job_id)
        except query.JobNotFound:
            raise SourceError(f"no job {job_id!r} in {self.where}") from None
        return JobInfo(
            job_id=s.job_id,
            name=s.name,
            benchmark_key=s.benchmark_key,
            status=s.status,
            started_at=s.started_at,
            world_size=s.world_size,
        )

    def data(self, job_id: str) -> JobData:
        from stepscope.query import history

        info = self.info(job_id)
        rollup = history.gate_rollup(self.engine, job_id)
        if rollup.is_empty():
            raise SourceError(
                f"job {job_id!r} has no step rollups yet: run `stepscope analyze {job_id}` "
                "(or wait for the server's analyzer)"
            )
        ranks = history.rank_levels(self.engine, job_id)
        return JobData(
            job_id=job_id,
            rollup=rollup,
            ranks=ranks if not ranks.is_empty() else None,
            started_at=info.started_at,
        )

    def history(
        self, benchmark_key: str, *, last: int, started_before: float | None, exclude: list[str]
    ) -> list[str]:
        from stepscope.query import history

        rows = history.comparable_jobs(
            self.engine,
            benchmark_key,
            last=last,
            started_before=started_before,
            exclude=exclude,
        )
        return [r.job_id for r in rows]


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


class ApiSource:
    """Jobs on a stepscope server, read through its REST API (/api/v1)."""

    def __init__(self, url: str, token: str | None, *, timeout_s: float = 30.0) -> None:
        import httpx

        self.where = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(
            base_url=f"{self.where}/api/v1", headers=headers, timeout=timeout_s
        )

    def _get(self, path: str, **params: Any) -> Any:
        import httpx

        try:
            response = self.client.get(
                path, params={k: v for k, v in params.items() if v is not None}
            )
        except httpx.HTTPError as exc:
            raise SourceError(f"cannot reach {self.where}: {exc}") from None
        if response.status_code == 404:
            raise SourceError(f"{self.where}: not found: {path}")
        if response.status_code in (401, 403):
            raise SourceError(f"{self.where} refused the request: give --token (scope read)")
        if response.is_error:
            raise SourceError(
                f"{self.where}{path}: HTTP {response.status_code}: {response.text[:200]}"
            )
        return response.json()

    def info(self, job_id: str) -> JobInfo:
        doc = self._get(f"/jobs/{job_id}")
        return JobInfo(
            job_id=doc["job_id"],
            name=doc.get("name"),
            benchmark_key=doc.get("benchmark_key"),
            status=doc.get("status", "unknown"),
            started_at=doc.get("started_at"),
            world_size=doc.get("world_size"),
        )

    def data(self, job_id: str) -> JobData:
        info = self._get(f"/jobs/{job_id}")
        if not info.get("num_steps"):
            raise SourceError(f"job {job_id!r} on {self.where} has no rolled-up steps yet")
        first, last = int(info["first_step"]), int(info["last_step"])
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
        rows = self._get(f"/jobs/{job_id}/ranks").get("ranks", [])
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
            started_at=info.get("started_at"),
        )

    def _series(
        self, job_id: str, column: str, metric: str, agg: str | None, lo: int, hi: int
    ) -> pl.DataFrame:
        """One step range of a series, whole (the range holds at most max_points steps)."""
        doc = self._get(
            f"/jobs/{job_id}/timeseries",
            metric=metric,
            agg=agg,
            from_step=lo,
            to_step=hi,
            max_points=API_MAX_POINTS,
        )
        return pl.DataFrame(
            {"step": doc["step"], column: doc["value"]},
            schema={"step": pl.Int64, column: pl.Float64},
        )

    def history(
        self, benchmark_key: str, *, last: int, started_before: float | None, exclude: list[str]
    ) -> list[str]:
        doc = self._get(
            "/jobs",
            benchmark_key=benchmark_key,
            status="finished",
            sort="-started_at",
            limit=last + len(exclude),
            started_before=started_before,
        )
        ids = [j["job_id"] for j in doc["jobs"]]
        return [i for i in ids if i not in exclude][:last]


def read_steps_files(paths: Sequence[Path], *, peak_flops: float | None = None) -> list[JobData]:
    """One JobData per job found in these canonical steps files (parquet or CSV)."""
    jobs = []
    for path in paths:
        if not path.is_file():
            raise SourceError(f"no such file: {path}")
        try:
            steps = pl.read_csv(path) if path.suffix == ".csv" else pl.read_parquet(path)
        except (OSError, pl.exceptions.PolarsError) as exc:
            raise SourceError(f"cannot read {path}: {exc}") from None
        missing = [c for c in ("rank", "step", "step_s", "data_s") if c not in steps.columns]
        if missing:
            raise SourceError(f"{path} has no {', '.join(missing)} column (canonical steps)")
        groups = (
            steps.partition_by("job_id", maintain_order=True)
            if "job_id" in steps.columns
            else [steps]
        )
        for part in groups:
            job_id = str(part["job_id"][0]) if "job_id" in part.columns else path.stem
            try:
                jobs.append(job_from_steps(part, job_id=job_id, peak_flops=peak_flops))
            except (ValueError, pl.exceptions.PolarsError) as exc:
                raise SourceError(f"cannot summarise {path}: {exc}") from None
    return jobs


def _redacted(url: str) -> str:
    """A database URL without its password."""
    head, sep, tail = url.partition("@")
    if not sep or "://" not in head:
        return url
    scheme, _, credentials = head.partition("://")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}@{tail}" if user else f"{scheme}://{tail}"
