"""Gate policy without the CLI: which candidate and baselines a check compares, what it
drops, and the exit code, on jobs stored in SQLite and on steps files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stepscope.check import plan
from stepscope.check.files import StepsFileError
from stepscope.client import LocalStore, StoreError
from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.synthetic.generate import JobSpec, Straggler, generate, to_frames
from tests.support import write_job_in_rounds

KEY = "bench/plan"
SLOW = (Straggler(ranks=(0, 1, 2, 3), factor=1.1, cause="compute", from_step=0),)


def _spec(job_id: str, hour: int, stragglers: tuple[Straggler, ...] = ()) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        num_ranks=4,
        ranks_per_node=4,
        num_steps=120,
        seed=hour,
        start_ts=1.7e9 + 3600 * hour,
        stragglers=stragglers,
        with_gpu=False,
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStore]:
    """Six analysed baselines of KEY, one stored but not rolled up (hour 6), a 10% slower
    candidate (hour 7) and a later job (hour 8) that must never be a baseline."""
    url = f"sqlite:///{tmp_path_factory.mktemp('plan') / 'stepscope.db'}"
    engine = make_engine(url)
    upgrade(engine)
    specs = [_spec(f"base-{h}", h) for h in range(6)]
    specs += [_spec("unrolled", 6), _spec("cand", 7, SLOW), _spec("later", 8)]
    for spec in specs:
        job = generate(spec)
        job.job["benchmark_key"] = KEY
        for _ in write_job_in_rounds(engine, job, steps_per_batch=60):
            pass
        if spec.job_id != "unrolled":
            JobAnalyzer(engine, spec.job_id, grace_s=0).run()
    engine.dispose()
    opened = LocalStore.open(url)
    yield opened
    opened.close()


def _parquet(tmp_path: Path, spec: JobSpec) -> Path:
    path = tmp_path / f"{spec.job_id}.parquet"
    to_frames(generate(spec))["steps"].write_parquet(path)
    return path


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "give a candidate"),
        ({"job_id": "cand", "candidate_steps": [Path("c.parquet")]}, "not both"),
        ({"job_id": "cand", "last": 0}, "--last must be >= 1"),
        ({"candidate_steps": [Path("c.parquet")]}, "no baseline: give --baseline-steps"),
    ],
)
def test_a_selection_that_names_no_comparison_is_a_usage_error(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(plan.UsageError, match=message):
        plan.Selection(**options)  # type: ignore[arg-type]


def test_baselines_from_history_are_the_keys_finished_jobs_started_before_the_candidate(
    store: LocalStore,
) -> None:
    jobs = plan.load_jobs(plan.Selection(job_id="cand"), store)
    assert [c.job_id for c in jobs.candidates] == ["cand"]
    assert [b.job_id for b in jobs.baselines] == [f"base-{h}" for h in range(5, -1, -1)]
    assert [d.job_id for d in jobs.unusable] == ["unrolled"]
    assert "no step rollups yet" in jobs.unusable[0].reason
    assert (jobs.benchmark_key, jobs.source) == (KEY, store.where)
    result = plan.compare(jobs, plan.check_config(None, alpha=0.01, min_effect=0.02, warmup="0"))
    assert result.outcome == "regression"
    assert plan.exit_code(result, fail_on="regression", allow_missing_baseline=False) == 1
    assert plan.exit_code(result, fail_on="never", allow_missing_baseline=False) == 0


def test_last_limits_the_history_and_too_few_baselines_exit_3_unless_allowed(
    store: LocalStore,
) -> None:
    jobs = plan.load_jobs(plan.Selection(job_id="cand", last=2), store)
    assert [b.job_id for b in jobs.baselines] == ["base-5"]  # the last 2, one not rolled up
    assert [d.job_id for d in jobs.unusable] == ["unrolled"]
    config = plan.check_config(None, alpha=0.01, min_effect=0.02, warmup="0")
    assert plan.compare(jobs, config).weak  # a 10% slowdown fails even so, as weak evidence
    unchanged = plan.load_jobs(plan.Selection(job_id="base-5", last=3), store)
    assert [b.job_id for b in unchanged.baselines] == ["base-4", "base-3", "base-2"]
    result = plan.compare(unchanged, config)
    assert (result.outcome, result.baseline_missing) == ("inconclusive", True)
    assert plan.exit_code(result, fail_on="regression", allow_missing_baseline=False) == 3
    assert plan.exit_code(result, fail_on="any", allow_missing_baseline=False) == 3
    assert plan.exit_code(result, fail_on="regression", allow_missing_baseline=True) == 0


def test_a_named_baseline_that_cannot_be_read_stops_the_check(store: LocalStore) -> None:
    with pytest.raises(StoreError, match="no step rollups yet"):
        plan.load_jobs(plan.Selection(job_id="cand", baseline=["base-0", "unrolled"]), store)
    with pytest.raises(StoreError, match="no job 'nope'"):
        plan.load_jobs(plan.Selection(job_id="nope"), store)


def test_files_alone_need_no_store_and_name_their_jobs_after_the_files(tmp_path: Path) -> None:
    selection = plan.Selection(
        candidate_steps=[_parquet(tmp_path, _spec("cand", 7, SLOW))],
        baseline_steps=[_parquet(tmp_path, _spec(f"base-{h}", h)) for h in range(3)],
    )
    assert not selection.needs_store
    jobs = plan.load_jobs(selection, None)
    assert [c.job_id for c in jobs.candidates] == ["cand"]
    assert [b.job_id for b in jobs.baselines] == ["base-0", "base-1", "base-2"]
    assert jobs.source == "files"
    with pytest.raises(StepsFileError, match="no such file"):
        plan.load_jobs(
            plan.Selection(
                job_id=None,
                candidate_steps=[tmp_path / "x.parquet"],
                baseline_steps=[tmp_path / "y.parquet"],
            ),
            None,
        )


def test_options_outside_the_gate_s_settings_are_usage_errors() -> None:
    with pytest.raises(plan.UsageError, match="unknown --metric step_time"):
        plan.check_config(["step_time"], alpha=0.01, min_effect=0.02, warmup="auto")
    with pytest.raises(plan.UsageError, match="--warmup-steps"):
        plan.check_config(None, alpha=0.01, min_effect=0.02, warmup="soon")
    with pytest.raises(plan.UsageError, match="--fail-on must be one of"):
        plan.checked_fail_on("sometimes")
    assert plan.check_config(["mfu", "mfu"], alpha=0.01, min_effect=0.02, warmup="5").metrics == (
        "mfu",
    )
