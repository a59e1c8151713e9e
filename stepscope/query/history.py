"""A benchmark's history for the regression gate: comparable jobs, their steps and ranks.

`stepscope check` reads stored jobs only through these (and the rest of stepscope.query):
the last finished jobs of a benchmark key, a job's step rollup in the columns of
stepscope.analysis.rollups.step_rollup, and each rank's typical time components.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl
import sqlalchemy as sa

from stepscope.query.common import check_at_least, require_job
from stepscope.query.jobs import MAX_LIMIT, JobFilters, JobRow, list_jobs
from stepscope.query.ranks import rank_table
from stepscope.store import reads, tables

GATE_COLUMNS = ("step", "num_ranks", "step_s_max", "data_s_max", "comm_wait_s_min", "tokens", "mfu")
"""The step-rollup columns the regression gate reads
(stepscope.analysis.frames.steady.job_metrics)."""


def comparable_jobs(
    engine: sa.Engine,
    benchmark_key: str,
    *,
    last: int = 10,
    started_before: float | None = None,
    exclude: Sequence[str] = (),
) -> list[JobRow]:
    """The `last` most recently started finished jobs with this benchmark key (started
    before `started_before`, none of `exclude`), newest first."""
    check_at_least("last", last, 1)
    filters = JobFilters(
        status=("finished",), benchmark_key=benchmark_key, started_before=started_before
    )
    limit = min(MAX_LIMIT, last + len(exclude))
    rows = list_jobs(engine, filters, sort="-started_at", limit=limit).jobs
    return [r for r in rows if r.job_id not in set(exclude)][:last]


def gate_rollup(
    engine: sa.Engine, job_id: str, *, columns: Sequence[str] = GATE_COLUMNS
) -> pl.DataFrame:
    """A job's step rollups (these columns, by step): empty until the analyzer rolled it up."""
    require_job(engine, job_id)
    return reads.read_rollup(engine, tables.step_rollups, job_id, columns=list(columns))


def rank_levels(engine: sa.Engine, job_id: str) -> pl.DataFrame:
    """Per rank of a job: rank, node and the median over step buckets of its data_s,
    compute_s, comm_wait_s and step_s (query.rank_table), ranks without steps left out."""
    table = rank_table(engine, job_id)
    frame = pl.DataFrame(
        {
            "rank": table.rank,
            "node": pl.Series(table.node, dtype=pl.String),
            **{m: table.median[m] for m in ("data_s", "compute_s", "comm_wait_s", "step_s")},
        }
    )
    return frame.filter(pl.col("step_s").is_not_nan())
