"""A pass is one unit of work: one that fails at any store call leaves the store as it was,
and the next pass (or `analyze --full`) stores the findings a clean run stores."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa

from stepscope.analysis import AnalysisConfig
from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.pipeline.resources import PassResources
from stepscope.schema import Finding
from stepscope.store import analysis_state, findings, frames, jobs, rollup_tables
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.synthetic.generate import JobSpec, Straggler, generate
from tests.support import fresh_postgres_database, write_job_in_rounds

# 1,200 steps of 1.5 s: the second pass outgrows 1,024 one-step rank buckets and 1,024
# one-second GPU buckets, so it re-buckets both.
SPEC = JobSpec(
    job_id="crashy",
    num_ranks=8,
    num_steps=1200,
    base_step_s=1.5,
    stragglers=(Straggler(ranks=(5,), factor=1.3, cause="compute", from_step=200),),
    seed=7,
)
CONFIG = AnalysisConfig(segment_cells=8 * 300)
STEPS_PER_BATCH = 100
FIRST_ROUNDS = 6
"""Rounds (of STEPS_PER_BATCH steps) stored before the first, clean pass: steps 0..599."""

STORE_CALLS: list[tuple[ModuleType, str]] = [
    (analysis_state, "load_state"),
    (analysis_state, "arrivals_since"),
    (analysis_state, "count_batches"),
    (analysis_state, "save_state"),
    (analysis_state, "save_summary"),
    (jobs, "load_job"),
    (jobs, "rank_nodes"),
    (frames, "read_frame"),
    (rollup_tables, "replace_step_rows"),
    (rollup_tables, "read_rank_buckets"),
    (rollup_tables, "delete_rank_buckets"),
    (rollup_tables, "write_rank_buckets"),
    (rollup_tables, "read_gpu_buckets"),
    (rollup_tables, "delete_gpu_buckets"),
    (rollup_tables, "write_gpu_buckets"),
    (rollup_tables, "read_step_rows"),
    (findings, "replace_findings"),
    (findings, "load_findings"),
]
"""Every store function a pass calls, as the module attribute it calls."""


class InjectedFailure(RuntimeError):
    """The process 'died' here."""


Values = list[tuple[Any, ...]]


def _values(found: list[Finding]) -> Values:
    return sorted(
        (
            f.kind,
            f.metric,
            tuple(f.ranks),
            f.node,
            f.first_step,
            f.last_step,
            f.cause,
            f.severity,
            round(f.expected or 0.0, 9),
            round(f.observed or 0.0, 9),
            round(f.effect or 0.0, 9),
        )
        for f in found
    )


def _store_first_rounds(engine: sa.Engine) -> Iterator[int]:
    rounds = write_job_in_rounds(engine, generate(SPEC), steps_per_batch=STEPS_PER_BATCH)
    for i in rounds:
        if i == FIRST_ROUNDS - 1:
            break
    return rounds


def _migrated(url: str) -> sa.Engine:
    engine = make_engine(url)
    upgrade(engine)
    return engine


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Values:
    """The findings of the same passes over the same job, none failing."""
    engine = _migrated(f"sqlite:///{tmp_path_factory.mktemp('clean') / 'clean.db'}")
    with PassResources() as resources:
        analyzer = JobAnalyzer(engine, SPEC.job_id, config=CONFIG, grace_s=0.0, resources=resources)
        rounds = _store_first_rounds(engine)
        analyzer.run()
        list(rounds)
        analyzer.run()
    stored = _values(findings.load_findings(engine, SPEC.job_id))
    engine.dispose()
    return stored


def _fail_once(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> list[int]:
    """Make `module.name` raise on its first call; the list counts the calls."""
    original: Callable[..., Any] = getattr(module, name)
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise InjectedFailure(f"{module.__name__}.{name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)
    return calls


def _fail_a_pass_then_recover(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str
) -> tuple[Values, Values]:
    """Pass over the first rounds, store the rest, fail the next pass at `module.name`; the
    findings stored by the pass that follows, and by a full re-analysis after it."""
    with PassResources() as resources:
        analyzer = JobAnalyzer(engine, SPEC.job_id, config=CONFIG, grace_s=0.0, resources=resources)
        rounds = _store_first_rounds(engine)
        analyzer.run()
        list(rounds)
        with monkeypatch.context() as patch:
            calls = _fail_once(patch, module, name)
            with pytest.raises(InjectedFailure):
                analyzer.run()
        assert calls, f"the pass never called {name}"
        analyzer.run()
        after_next_pass = _values(findings.load_findings(engine, SPEC.job_id))
        analyzer.run(full=True)
        after_full = _values(findings.load_findings(engine, SPEC.job_id))
    return after_next_pass, after_full


@pytest.mark.parametrize(
    ("module", "name"),
    STORE_CALLS,
    ids=[f"{m.__name__.rsplit('.', 1)[1]}.{n}" for m, n in STORE_CALLS],
)
def test_a_pass_failing_at_any_store_call_leaves_findings_the_next_pass_makes_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: Values, module: ModuleType, name: str
) -> None:
    engine = _migrated(f"sqlite:///{tmp_path / 'stepscope.db'}")
    try:
        after_next_pass, after_full = _fail_a_pass_then_recover(engine, monkeypatch, module, name)
    finally:
        engine.dispose()
    assert after_next_pass == clean
    assert after_full == clean
    straggler = [v for v in clean if v[0] == "straggler_rank"]
    assert [(v[2], v[6]) for v in straggler] == [((5,), "compute")]
    assert abs(straggler[0][4] - 200) <= 20


def test_a_failed_full_re_analysis_leaves_the_stored_analysis_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: Values
) -> None:
    engine = _migrated(f"sqlite:///{tmp_path / 'stepscope.db'}")
    try:
        with PassResources() as resources:
            analyzer = JobAnalyzer(
                engine, SPEC.job_id, config=CONFIG, grace_s=0.0, resources=resources
            )
            list(write_job_in_rounds(engine, generate(SPEC), steps_per_batch=STEPS_PER_BATCH))
            analyzer.run()
            for module, name in [(rollup_tables, "delete_job_rollups"), *STORE_CALLS[-3:]]:
                with monkeypatch.context() as patch:
                    calls = _fail_once(patch, module, name)
                    with pytest.raises(InjectedFailure):
                        analyzer.run(full=True)
                assert calls, f"the full pass never called {name}"
                assert _values(findings.load_findings(engine, SPEC.job_id)) == clean
                assert analyzer.run().findings == [], "no new batches: nothing to redo"
            assert _values(analyzer.run(full=True).findings) == clean
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("module", "name"),
    [(findings, "replace_findings"), (analysis_state, "save_summary")],
    ids=["replace_findings", "save_summary"],
)
def test_on_postgresql_a_pass_failing_after_its_state_was_saved_loses_nothing(
    monkeypatch: pytest.MonkeyPatch, clean: Values, module: ModuleType, name: str
) -> None:
    with fresh_postgres_database() as url:
        engine = _migrated(url)
        try:
            after_next_pass, after_full = _fail_a_pass_then_recover(
                engine, monkeypatch, module, name
            )
        finally:
            engine.dispose()
    assert after_next_pass == clean
    assert after_full == clean
