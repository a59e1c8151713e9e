"""A pass is one unit of work: one that fails at any store call leaves the store as it was,
and the next pass (or `analyze --full`) stores the findings a clean run stores; in the server,
a job whose pass fails holds up neither ingest, the API nor the other jobs' passes, and its
pass is retried."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest
import sqlalchemy as sa

from stepscope.analysis import AnalysisConfig
from stepscope.pipeline import scheduler
from stepscope.pipeline.job_pass import JobAnalyzer, PassResult
from stepscope.pipeline.resources import PassResources
from stepscope.schema import Finding
from stepscope.server.app import create_app
from stepscope.server.settings import Settings
from stepscope.store import analysis_state, findings, frames, jobs, rollup_tables
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.synthetic.generate import JobSpec, Straggler, generate
from stepscope.synthetic.stream import stream_job
from tests.live_server import free_port, wait_healthy
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


class _PoisonedAnalyzer(JobAnalyzer):
    """The server's analyzer, failing its first POISONED_FAILURES passes over POISONED."""

    failures: ClassVar[list[str]] = []

    def run(self, *, full: bool = False) -> PassResult:
        if self.job_id == POISONED and len(self.failures) < POISONED_FAILURES:
            self.failures.append(self.job_id)
            raise InjectedFailure(f"pass over {self.job_id}")
        return super().run(full=full)


POISONED, HEALTHY, POISONED_FAILURES = "poisoned", "healthy", 2


@contextmanager
def _server_in_process(settings: Settings) -> Iterator[str]:
    """The real app on a loopback port, in this process (so a pass can be made to fail)."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=settings.port, log_level="error"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    try:
        wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _analysed(url: str, job_id: str) -> bool:
    with urllib.request.urlopen(f"{url}/api/v1/jobs/{job_id}", timeout=30) as response:
        return json.loads(response.read())["analysed_at"] is not None


def _wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_failing_pass_holds_up_neither_ingest_the_api_nor_other_jobs_and_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(scheduler, "JobAnalyzer", _PoisonedAnalyzer)
    _PoisonedAnalyzer.failures.clear()
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'stepscope.db'}",
        port=free_port(),
        analyze_interval_s=0.3,
        rollup_grace_s=0.0,
    )
    jobs_now = {
        job_id: generate(
            JobSpec(job_id=job_id, num_ranks=4, num_steps=200, start_ts=time.time() - 300, seed=1)
        )
        for job_id in (POISONED, HEALTHY)
    }
    with caplog.at_level(logging.WARNING), _server_in_process(settings) as url:
        for job in jobs_now.values():
            sent = stream_job(job, url, steps_per_batch=50)
            assert sent.failures == []
            assert sent.batches == 16
        # While the poisoned job's passes fail, the other job is analysed and ingest answers.
        # A round takes the jobs one after the other, the healthy one first here: wait for
        # both, not for the healthy one alone (the poisoned pass may not have run by then).
        _wait_until(lambda: bool(_PoisonedAnalyzer.failures) and _analysed(url, HEALTHY))
        more = generate(JobSpec(job_id="later", num_ranks=2, num_steps=20, seed=2))
        assert stream_job(more, url, steps_per_batch=20).batches == 2
        # Retried at the next passes, it is analysed once its failures stop.
        _wait_until(lambda: _analysed(url, POISONED))
        with urllib.request.urlopen(f"{url}/api/v1/jobs/{POISONED}/findings", timeout=30) as r:
            assert r.status == 200
    assert _PoisonedAnalyzer.failures == [POISONED] * POISONED_FAILURES
    failed = [r for r in caplog.records if "analysis of job poisoned failed" in r.getMessage()]
    assert [r.exc_info is not None for r in failed] == [True, False]  # one traceback, then a line
    assert "failed again (2 times in a row)" in failed[1].getMessage()
