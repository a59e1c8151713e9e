"""Rollup-derived answers are reused until the job's next analyzer pass, then recomputed."""

from __future__ import annotations

import logging
from typing import Any

import adbc_driver_postgresql.dbapi
import numpy as np
import pytest

from stepscope import query
from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.pipeline.resources import PassResources
from stepscope.pipeline.scheduler import BackgroundAnalyzer
from stepscope.store import reads
from stepscope.store.engine import make_engine
from stepscope.synthetic.generate import JobSpec, Straggler, generate
from tests.live_server import free_port
from tests.support import assert_one_outage_logged, write_job_in_rounds


@pytest.fixture
def engine(db_url: str) -> Any:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


def test_rank_table_and_heatmap_are_reused_within_a_pass_and_recomputed_after_one(
    engine: Any,
) -> None:
    spec = JobSpec(
        job_id="memo",
        num_ranks=4,
        num_steps=200,
        stragglers=(Straggler(ranks=(2,), factor=1.5, cause="compute", from_step=100),),
        seed=3,
    )
    rounds = write_job_in_rounds(engine, generate(spec), steps_per_batch=100)
    next(rounds)
    JobAnalyzer(engine, spec.job_id, grace_s=0.0).run()
    before = query.rank_table(engine, spec.job_id)
    assert query.rank_table(engine, spec.job_id) is before
    heat = query.heatmap(engine, spec.job_id, "compute_s", max_ranks=4, max_steps=50)
    assert heat is not None
    assert query.heatmap(engine, spec.job_id, "compute_s", max_ranks=4, max_steps=50) is heat
    assert query.heatmap(engine, spec.job_id, "compute_s", max_ranks=4, max_steps=20) is not heat

    list(rounds)  # rank 2 slows down in the second half: stored, but not yet analysed
    assert query.rank_table(engine, spec.job_id) is before
    JobAnalyzer(engine, spec.job_id, grace_s=0.0).run()
    after = query.rank_table(engine, spec.job_id)
    assert after is not before
    assert after.rank[0] == 2  # the slowest first
    slow = after.mean["compute_s"][after.rank == 2][0]
    assert slow > 1.15 * before.mean["compute_s"][before.rank == 2][0]
    heat_after = query.heatmap(engine, spec.job_id, "compute_s", max_ranks=4, max_steps=50)
    assert heat_after is not None
    assert (heat.step_edges[-1], heat_after.step_edges[-1]) == (100, 200)
    assert np.isfinite(heat_after.values).all()


def test_the_background_analyzer_computes_the_rank_table_after_its_pass(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = JobSpec(job_id="warm", num_ranks=4, num_steps=120, seed=4)
    list(write_job_in_rounds(engine, generate(spec), steps_per_batch=60))
    read: list[str] = []
    original = reads.read_bucket_matrices

    def recording(engine_: Any, job_id: str, **kwargs: Any) -> Any:
        read.append(job_id)
        return original(engine_, job_id, **kwargs)

    monkeypatch.setattr(reads, "read_bucket_matrices", recording)
    with PassResources() as resources:
        analyzer = BackgroundAnalyzer(
            engine, interval_s=60, active_within_s=3600, resources=resources
        )
        assert analyzer.run_once() == 1
    assert read == ["warm"]
    table = query.rank_table(engine, spec.job_id)  # answered from memory
    assert read == ["warm"]
    assert sorted(table.rank.tolist()) == [0, 1, 2, 3]


def test_an_outage_during_the_rank_table_is_one_outage_line_not_a_traceback(
    engine: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spec = JobSpec(job_id="outage-warm", num_ranks=2, num_steps=60, seed=5)
    list(write_job_in_rounds(engine, generate(spec), steps_per_batch=60))
    with pytest.raises(adbc_driver_postgresql.dbapi.OperationalError) as refused:
        adbc_driver_postgresql.dbapi.connect(f"postgresql://postgres@127.0.0.1:{free_port()}/x")

    def down(*_: Any, **__: Any) -> Any:
        raise refused.value  # what the Arrow reader raises when PostgreSQL stops mid-pass

    monkeypatch.setattr(reads, "read_bucket_matrices", down)
    with PassResources() as resources, caplog.at_level(logging.WARNING):
        analyzer = BackgroundAnalyzer(
            engine, interval_s=60, active_within_s=3600, resources=resources
        )
        assert analyzer.run_once() == 1
    assert_one_outage_logged(caplog)
