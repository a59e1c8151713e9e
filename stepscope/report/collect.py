"""What a job report shows, read through stepscope.query (no SQL, no statistics here)."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from stepscope import query
from stepscope.analysis.regression.gate import CheckResult

MAX_POINTS = 2000
"""Points per series in the report (min/max-preserving downsampling in the query layer)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportData:
    """A stored job's summary, series, ranks and findings, and the gate's verdict if any."""

    summary: query.JobSummary
    band: query.Band
    tokens_per_s: query.Series
    mfu: query.Series
    ranks: query.RankTable
    findings: list[query.StoredFinding]
    verdict: CheckResult | None


def collect(engine: sa.Engine, job_id: str, verdict: CheckResult | None = None) -> ReportData:
    """Everything the report of `job_id` shows; raises query.JobNotFound for an unknown job."""
    return ReportData(
        summary=query.job_summary(engine, job_id),
        band=query.step_band(engine, job_id, "step_s", max_points=MAX_POINTS),
        tokens_per_s=query.step_series(engine, job_id, "tokens_per_s", max_points=MAX_POINTS),
        mfu=query.step_series(engine, job_id, "mfu", max_points=MAX_POINTS),
        ranks=query.rank_table(engine, job_id),
        findings=query.findings(engine, job_id),
        verdict=verdict,
    )
