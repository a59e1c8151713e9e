"""list_jobs (filters, sort, cursor pages), job_summary, findings and unknown jobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import polars as pl
import pytest

from stepscope import query
from stepscope.query import JobFilters, JobNotFound
from tests.query.conftest import (
    EVENTS,
    JOB,
    NUM_RANKS,
    NUM_STEPS,
    SMALL_JOBS,
    STALE_JOB,
    START_TS,
    Stored,
)


def all_pages(stored: Stored, sort: str, limit: int, **filters: Any) -> list[query.JobRow]:
    """Every page of a listing, following next_cursor."""
    rows: list[query.JobRow] = []
    cursor = None
    while True:
        page = query.list_jobs(
            stored.engine, JobFilters(**filters), sort=sort, cursor=cursor, limit=limit
        )
        assert len(page.jobs) <= limit
        rows += page.jobs
        if page.next_cursor is None:
            return rows
        cursor = page.next_cursor


def expected_order(rows: list[query.JobRow], key: str, descending: bool) -> list[str]:
    """job_ids sorted by `key` (NULLs last in both directions), ties by job_id."""
    present = [r for r in rows if getattr(r, key) is not None]
    present.sort(key=lambda r: r.job_id)
    present.sort(key=lambda r: getattr(r, key), reverse=descending)
    missing = sorted((r for r in rows if getattr(r, key) is None), key=lambda r: r.job_id)
    return [r.job_id for r in present + missing]


@pytest.mark.parametrize(
    "sort", ["-started_at", "started_at", "name", "-name", "-step_p50_s", "mfu", "world_size"]
)
@pytest.mark.parametrize("limit", [1, 2, 3, 50])
def test_pages_cover_every_job_once_in_sort_order(stored: Stored, sort: str, limit: int) -> None:
    rows = all_pages(stored, sort, limit)

    assert sorted(r.job_id for r in rows) == sorted(stored.job_ids)
    key = sort.removeprefix("-")
    assert [r.job_id for r in rows] == expected_order(rows, key, sort.startswith("-"))


def test_null_sort_values_come_last_and_ties_break_by_job_id(stored: Stored) -> None:
    by_p50 = all_pages(stored, "step_p50_s", 2)
    unanalysed = sorted(s["job_id"] for s in SMALL_JOBS if not s["analysed"])
    assert [r.job_id for r in by_p50[-len(unanalysed) :]] == unanalysed
    assert all(r.step_p50_s is None for r in by_p50[-len(unanalysed) :])

    # j-d and j-e started at the same second: their order is by job_id in both directions
    for sort in ("started_at", "-started_at"):
        ids = [r.job_id for r in all_pages(stored, sort, 1)]
        assert ids.index("j-d") < ids.index("j-e")


def test_filters_select_by_status_key_name_start_and_severity(stored: Stored) -> None:
    def ids(**filters: Any) -> list[str]:
        return sorted(r.job_id for r in all_pages(stored, "-started_at", 2, **filters))

    def these(*job_ids: str) -> list[str]:
        return sorted(job_ids)

    assert ids(status=("stale",)) == [STALE_JOB]
    assert ids(status=("running",)) == ["j-c", "j-d"]
    assert ids(status=("finished",)) == these(JOB, "j-b", "j-f", "j-g")
    assert ids(status=("running", "stale")) == ["j-c", "j-d", "j-e"]
    assert ids(benchmark_key="bench/y") == ["j-c", "j-d", "j-e"]
    assert ids(name_contains="train") == these(JOB, "j-b", "j-c")  # case-insensitive
    assert ids(name_contains="%") == ["j-b", "j-g"]  # wildcards match themselves
    assert ids(name_contains="_") == ["j-b", "j-e"]
    assert ids(name_contains="x%y") == ["j-g"]
    assert ids(started_after=START_TS + 300, started_before=START_TS + 500) == [
        "j-d",
        "j-e",
        "j-f",
    ]
    assert ids(benchmark_key="bench/y", status=("running",)) == ["j-c", "j-d"]

    severities = ("info", "warning", "critical")
    for level in severities:
        wanted = [
            job_id
            for job_id in stored.job_ids
            if any(
                severities.index(f.severity) >= severities.index(level)
                for f in query.findings(stored.engine, job_id)
            )
        ]
        assert ids(min_severity=level) == sorted(wanted)
    assert ids(min_severity="critical") == [JOB]


def test_rows_carry_summary_figures_and_finding_counts(stored: Stored) -> None:
    rows = {r.job_id: r for r in all_pages(stored, "name", 50)}
    main = rows[JOB]
    summary = query.job_summary(stored.engine, JOB)
    assert main.world_size == NUM_RANKS
    assert main.num_nodes == 4
    assert main.step_p50_s == summary.step_p50_s
    assert main.mfu == summary.mfu
    found = query.findings(stored.engine, JOB)
    assert main.num_critical == sum(f.severity == "critical" for f in found) > 0
    assert rows["j-d"].num_critical is None
    assert rows["j-d"].step_p50_s is None


def test_job_summary_describes_the_job(stored: Stored) -> None:
    s = query.job_summary(stored.engine, JOB)
    steps = stored.steps
    step_s = steps.group_by("step").agg(pl.col("step_s").max())["step_s"]

    assert (s.world_size, s.num_nodes, s.num_ranks_seen) == (NUM_RANKS, 4, NUM_RANKS)
    assert (s.num_steps, s.first_step, s.last_step) == (NUM_STEPS, 0, NUM_STEPS - 1)
    assert s.status == "finished"
    assert s.device_name == stored.job["device_name"]
    assert s.peak_flops == stored.job["peak_flops"]
    assert s.started_at == pytest.approx(float(steps["ts"].min()))  # type: ignore[arg-type]
    assert s.step_p50_s is not None
    assert float(step_s.min()) <= s.step_p50_s <= float(step_s.max())  # type: ignore[arg-type]
    shares = (s.data_share or 0) + (s.compute_share or 0) + (s.comm_wait_share or 0)
    assert shares == pytest.approx(1.0)
    found = query.findings(stored.engine, JOB)
    for severity in ("info", "warning", "critical"):
        assert getattr(s, f"num_{severity}") == sum(f.severity == severity for f in found)
    assert query.job_summary(stored.engine, STALE_JOB).status == "stale"


def test_findings_have_ids_and_the_straggler(stored: Stored) -> None:
    found = query.findings(stored.engine, JOB)
    assert len({f.id for f in found}) == len(found)
    assert any(f.kind == "straggler_rank" and f.ranks == [5] for f in found)


def test_bad_arguments_name_the_argument(stored: Stored) -> None:
    with pytest.raises(ValueError, match="sort must be one of"):
        query.list_jobs(stored.engine, sort="-speed")
    with pytest.raises(ValueError, match="limit"):
        query.list_jobs(stored.engine, limit=0)
    with pytest.raises(ValueError, match="status must be one of"):
        JobFilters(status=("done",))
    with pytest.raises(ValueError, match="min_severity"):
        JobFilters(min_severity="high")
    with pytest.raises(ValueError, match="cursor"):
        query.list_jobs(stored.engine, cursor="not-a-cursor")
    page = query.list_jobs(stored.engine, sort="name", limit=1)
    assert page.next_cursor is not None
    with pytest.raises(ValueError, match="cursor was made for sort"):
        query.list_jobs(stored.engine, sort="-name", cursor=page.next_cursor)


UNKNOWN_JOB_CALLS: list[Callable[..., Any]] = [
    query.job_summary,
    query.findings,
    lambda e, j: query.step_series(e, j, "step_s"),
    query.step_band,
    query.rank_table,
    query.heatmap,
    query.collective_stats,
    query.gpu_series,
    lambda e, j: query.export(e, j, "steps", "parquet"),
]


@pytest.mark.parametrize("call", UNKNOWN_JOB_CALLS)
def test_an_unknown_job_raises_job_not_found(stored: Stored, call: Callable[..., Any]) -> None:
    with pytest.raises(JobNotFound, match="no-such-job"):
        call(stored.engine, "no-such-job")


def test_events_come_in_time_order_with_their_attributes(stored: Stored) -> None:
    got = query.events(stored.engine, JOB)
    assert [(e["rank"], e["ts"], e["kind"], e["message"]) for e in got] == [
        (2, e["ts"], e["kind"], e["message"]) for e in EVENTS
    ]
    assert got[1]["attributes"] == {"xid": 79, "gpu": 0}
    assert [e["kind"] for e in query.events(stored.engine, JOB, limit=1)] == ["restart"]
    with pytest.raises(ValueError, match="limit"):
        query.events(stored.engine, JOB, limit=0)
    with pytest.raises(query.JobNotFound):
        query.events(stored.engine, "no-such-job")
