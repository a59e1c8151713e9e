"""Incremental analysis on SQLite and PostgreSQL: rollups and findings from a watermark."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import polars as pl
import pytest
import sqlalchemy as sa

from stepscope.analysis import AnalysisConfig, analyze, rollups
from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.pipeline.resources import PassResources
from stepscope.schema import Finding
from stepscope.store import frames, reads, rollup_tables, tables
from stepscope.store.engine import make_engine
from stepscope.store.writer import BatchWriter
from stepscope.synthetic.generate import JobSpec, Straggler, generate, to_frames
from tests.support import write_job_in_rounds

# Segments of 200 steps: the job below spans five, and the stragglers cross boundaries.
CONFIG = AnalysisConfig(segment_cells=16 * 200)
SPEC = JobSpec(
    job_id="streamed",
    num_ranks=16,
    num_steps=1000,
    stragglers=(
        Straggler(ranks=(3,), factor=1.2, cause="compute", from_step=150),
        Straggler(ranks=(9,), factor=1.25, cause="data", from_step=330, until_step=560),
    ),
    busbw_shifts=((700, 0.5),),
    seed=11,
)


@pytest.fixture
def engine(db_url: str) -> Any:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


def _rollup(engine: sa.Engine, table: sa.Table, job_id: str, **steps: int) -> pl.DataFrame:
    columns = [c.name for c in table.c if c.name != "job_id"]
    return reads.read_rollup(engine, table, job_id, columns=columns, **steps)


def _comparable(findings: list[Finding]) -> list[tuple[Any, ...]]:
    return sorted(
        (f.kind, f.metric, tuple(f.ranks), f.node, f.first_step, f.last_step, f.cause, f.severity)
        for f in findings
    )


def _figures(findings: list[Finding]) -> dict[tuple[Any, ...], tuple[float, ...]]:
    return {
        (f.kind, f.metric, tuple(f.ranks), f.first_step): (
            f.expected or 0.0,
            f.observed or 0.0,
            f.effect or 0.0,
        )
        for f in findings
    }


def test_passes_over_a_job_streamed_in_pieces_equal_one_full_analysis(engine: Any) -> None:
    job = generate(SPEC)
    analyzer = JobAnalyzer(engine, SPEC.job_id, config=CONFIG, grace_s=0.0)
    analysed: list[list[int]] = []
    for i in write_job_in_rounds(engine, job, steps_per_batch=25):
        if i % 3 == 2:
            analysed.append(analyzer.run().analysed_segments)
    incremental = analyzer.run().findings

    full = JobAnalyzer(engine, SPEC.job_id, config=CONFIG, grace_s=0.0).run(full=True).findings
    frames = to_frames(job)
    offline = analyze(
        frames["steps"],
        collectives=frames["collectives"],
        gpu=frames["gpu"],
        ranks=frames["ranks"],
        job=frames["jobs"].row(0, named=True),
        config=CONFIG,
    )

    assert _comparable(incremental) == _comparable(full) == _comparable(offline)
    for key, figures in _figures(full).items():
        assert _figures(incremental)[key] == pytest.approx(figures), key
        assert _figures(offline)[key] == pytest.approx(figures), key
    found = {(f.kind, tuple(f.ranks), f.cause) for f in full}
    assert ("straggler_rank", (3,), "compute") in found
    assert ("straggler_rank", (9,), "data") in found
    assert ("slow_collective", (), "communication") in found
    (recovered,) = [f for f in full if f.kind == "straggler_rank" and f.ranks == [9]]
    assert abs((recovered.last_step or 0) - 560) <= 20
    # A live job re-analyses only the segments its new steps touch, not the whole job.
    assert max(len(a) for a in analysed) <= 2
    assert analysed[-1] == [4]


def test_rollups_equal_a_direct_computation_over_the_raw_rows(engine: Any) -> None:
    spec = JobSpec(job_id="rolled", num_ranks=8, num_steps=300, seed=2)
    job = generate(spec)
    analyzer = JobAnalyzer(engine, spec.job_id, grace_s=0.0)
    for _ in write_job_in_rounds(engine, job, steps_per_batch=40):
        analyzer.run()
    frames = to_frames(job)
    meta = frames["jobs"].row(0, named=True)

    stored = _rollup(engine, tables.step_rollups, spec.job_id)
    direct = rollups.step_rollup(
        frames["steps"], peak_flops=meta["peak_flops"], world_size=meta["world_size"]
    )
    _assert_frames_close(stored, direct)
    _assert_frames_close(
        _rollup(engine, tables.op_rollups, spec.job_id),
        rollups.op_rollup(frames["collectives"]),
    )
    buckets = rollup_tables.read_rank_buckets(engine, spec.job_id)
    assert buckets is not None
    assert buckets.bucket_steps == 1
    _assert_frames_close(buckets.frame(), rollups.rank_buckets(frames["steps"], 1), rel=1e-6)
    gpu = rollup_tables.read_gpu_buckets(engine, spec.job_id)
    assert gpu is not None
    width, gpu_frame = gpu
    _assert_frames_close(
        gpu_frame.sort("first_ts", "rank", "gpu_index"),
        rollups.gpu_buckets(frames["gpu"], width),
    )


def _assert_frames_close(got: pl.DataFrame, want: pl.DataFrame, rel: float = 1e-9) -> None:
    got = got.select(want.columns)
    assert got.height == want.height
    for name in want.columns:
        a, b = got[name].to_numpy(), want[name].to_numpy()
        if a.dtype.kind in "fc" or b.dtype.kind in "fc":
            assert np.allclose(a.astype(float), b.astype(float), rtol=rel, equal_nan=True), name
        else:
            assert a.tolist() == b.tolist(), name


def test_a_restarted_analyzer_resumes_from_the_stored_watermark(engine: Any) -> None:
    spec = JobSpec(job_id="resumed", num_ranks=8, num_steps=200, seed=4)
    rounds = write_job_in_rounds(engine, generate(spec), steps_per_batch=50)
    next(rounds)
    next(rounds)
    first = JobAnalyzer(engine, spec.job_id, grace_s=0.0).run()
    assert first.rolled_up_steps == 100

    again = JobAnalyzer(engine, spec.job_id, grace_s=0.0).run()  # a new server process
    assert (again.rolled_up_steps, again.analysed_segments) == (0, [])

    next(rounds)
    after = JobAnalyzer(engine, spec.job_id, grace_s=0.0).run()
    assert after.rolled_up_steps == 50
    stored = _rollup(engine, tables.step_rollups, spec.job_id)
    assert stored["step"].to_list() == list(range(150))
    rounds.close()


def _steps_batch(rank: int, steps: range, *, step_s: float = 1.0) -> dict[str, Any]:
    n = len(steps)
    # Stamped when written (not when the module was collected, which may be more than the
    # hour of grace earlier on a slow machine): 2000 s ago, inside the grace period.
    start = time.time() - 2000.0
    return {
        "job": {"job_id": "late", "world_size": 4},
        "source": {"rank": rank, "incarnation": "i", "node": f"host-{rank // 2}"},
        "seq": steps.start,
        "sections": {
            "steps": {
                "job_id": ["late"] * n,
                "rank": [rank] * n,
                "step": list(steps),
                "ts": [start + s for s in steps],
                "step_s": [step_s + 0.01 * rank] * n,
                "data_s": [0.1] * n,
            }
        },
    }


def test_late_rows_are_held_back_then_rolled_up_and_resent_rows_change_nothing(
    engine: Any,
) -> None:
    writer = BatchWriter(engine)
    try:
        for rank in range(4):
            writer.write(**_steps_batch(rank, range(0, 30)))
            if rank != 2:
                writer.write(**_steps_batch(rank, range(30, 40)))
        waiting = JobAnalyzer(engine, "late", grace_s=3600.0)
        assert waiting.run().rolled_up_steps == 30  # steps 30..39 wait for rank 2

        writer.write(**_steps_batch(2, range(30, 40)))
        assert waiting.run().rolled_up_steps == 10
        rollup = _rollup(engine, tables.step_rollups, "late")
        assert rollup["num_ranks"].to_list() == [4] * 40
        assert rollup["slowest_rank"].to_list() == [3] * 40

        writer.write(**_steps_batch(2, range(30, 40), step_s=9.0))  # a resend: stored once
        waiting.run()
        assert _rollup(engine, tables.step_rollups, "late").equals(rollup)

        # Without a grace period an incomplete step is rolled up, and updated when the rest
        # arrives.
        eager = JobAnalyzer(engine, "late", grace_s=0.0)
        for rank in (0, 1, 3):
            writer.write(**_steps_batch(rank, range(40, 45)))
        eager.run()
        partial = _rollup(engine, tables.step_rollups, "late", from_step=40)
        assert partial["num_ranks"].to_list() == [3] * 5
        writer.write(**_steps_batch(2, range(40, 45)))
        eager.run()
        complete = _rollup(engine, tables.step_rollups, "late", from_step=40)
        assert complete["num_ranks"].to_list() == [4] * 5
    finally:
        writer.close()


def test_rank_buckets_widen_as_the_job_grows(engine: Any) -> None:
    writer = BatchWriter(engine)
    analyzer = JobAnalyzer(engine, "late", grace_s=0.0)
    try:
        for rank in range(4):
            writer.write(**_steps_batch(rank, range(0, 1000)))
        analyzer.run()
        before = rollup_tables.read_rank_buckets(engine, "late")
        for rank in range(4):
            writer.write(**_steps_batch(rank, range(1000, 1100)))
        analyzer.run()
    finally:
        writer.close()
    after = rollup_tables.read_rank_buckets(engine, "late")
    assert before is not None
    assert after is not None
    assert (before.bucket_steps, after.bucket_steps) == (1, 2)
    assert after.first_steps.tolist() == list(range(0, 1100, 2))
    assert np.allclose(after.stats["step_s_count"], 2)
    assert np.allclose(after.stats["step_s_sum"][:, 3], 2 * 1.03)
    with engine.connect() as conn:
        widths = conn.execute(sa.select(tables.rank_buckets.c.bucket_steps).distinct()).all()
    assert widths == [(2,)]


def test_a_live_pass_reads_from_the_store_only_the_steps_its_new_batches_touched(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = JobSpec(job_id="live", num_ranks=8, num_steps=400, seed=5)
    job = generate(spec)
    config = AnalysisConfig(segment_cells=8 * 200)  # segment 1: steps 220..419, read from 170
    read_from: list[int] = []
    original = frames.read_frame

    def recording(engine_: Any, table: str, job_id: str, **filters: Any) -> pl.DataFrame:
        if table == "steps":
            read_from.append(filters["from_step"])
        return original(engine_, table, job_id, **filters)

    monkeypatch.setattr(frames, "read_frame", recording)
    server = PassResources()  # what one server process keeps between passes
    rounds = write_job_in_rounds(engine, job, steps_per_batch=50)
    for i in rounds:
        read_from.clear()
        JobAnalyzer(engine, spec.job_id, config=config, grace_s=0.0, resources=server).run()
        if i == 5:
            break
    # Round 5 wrote steps 250..299: of its segment's steps 170..299, those before 250 are
    # the previous pass's rows, kept in memory.
    assert read_from == [250]

    # A new server process: the segment's rows come from the store.
    server.close()
    server = PassResources()
    next(rounds)
    JobAnalyzer(engine, spec.job_id, config=config, grace_s=0.0, resources=server).run()
    assert read_from[-1] == 170
    list(rounds)
    incremental = JobAnalyzer(engine, spec.job_id, config=config, grace_s=0.0).run().findings
    full = JobAnalyzer(engine, spec.job_id, config=config, grace_s=0.0).run(full=True).findings
    server.close()
    assert _comparable(incremental) == _comparable(full)
