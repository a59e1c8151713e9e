"""The incremental pass over a job with collectives per process group, on SQLite and
PostgreSQL: the same findings as analyze(), op rollups per group label, and the ranks' mesh."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

from stepscope.analysis import AnalysisConfig, analyze, rollups
from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.store import findings, jobs, reads, tables
from stepscope.store.engine import make_engine
from tests.mesh_jobs import JOB_ID, LATE_FROM, LATE_RANK, mesh_job, mesh_of, write_in_rounds

# Segments of 200 steps: rank 3's slowdown from step 150 crosses the boundary at step 220.
CONFIG = AnalysisConfig(segment_cells=4 * 200)


@pytest.fixture
def engine(db_url: str) -> Any:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


def test_passes_over_a_mesh_job_name_the_group_as_analyze_does(engine: Any) -> None:
    frames = mesh_job()
    analyzer = JobAnalyzer(engine, JOB_ID, config=CONFIG, grace_s=0.0)
    for _ in write_in_rounds(engine, frames, steps=50):
        analyzer.run()
    incremental = findings.load_findings(engine, JOB_ID)
    full = JobAnalyzer(engine, JOB_ID, config=CONFIG, grace_s=0.0).run(full=True).findings
    offline = analyze(
        frames["steps"],
        collectives=frames["collectives"],
        ranks=frames["ranks"],
        job={"job_id": JOB_ID, "world_size": 4},
        config=CONFIG,
    )

    def comparable(findings: list[Any]) -> list[tuple[Any, ...]]:
        return sorted(
            (f.kind, f.metric, tuple(f.ranks), f.first_step, f.last_step, f.cause, f.severity)
            for f in findings
        )

    assert comparable(incremental) == comparable(full) == comparable(offline)
    (straggler,) = [f for f in full if f.kind == "straggler_rank"]
    assert (straggler.ranks, straggler.cause) == ([LATE_RANK], "compute")
    assert straggler.first_step == pytest.approx(LATE_FROM, abs=2)
    (offline_straggler,) = [f for f in offline if f.kind == "straggler_rank"]
    for found in (incremental, full):
        (f,) = [f for f in found if f.kind == "straggler_rank"]
        assert f.evidence["group"]["group"] == "dp_shard"
        assert f.evidence["group"] == pytest.approx(offline_straggler.evidence["group"])

    assert jobs.rank_meshes(engine, JOB_ID) == {r: mesh_of(r) for r in range(4)}
    columns = [c.name for c in tables.op_rollups.c if c.name != "job_id"]
    stored = reads.read_rollup(engine, tables.op_rollups, JOB_ID, columns=columns)
    direct = rollups.op_rollup(frames["collectives"])
    assert (
        stored.select("step", "group", "op").rows() == direct.select("step", "group", "op").rows()
    )
    assert stored.filter(pl.col("step") == 0)["group"].to_list() == ["dp_shard", "tp"]
    for column in ("busy_s_min", "busy_s_max", "busbw_p50_bps"):
        assert stored[column].to_list() == pytest.approx(direct[column].to_list(), rel=1e-9)
