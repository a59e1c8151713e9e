"""Gate policy: which candidate and baselines a check compares, and its exit code.

Baselines are the jobs the user names (by id or steps file), else the last finished jobs
of the candidate's benchmark key started before it; a history job that cannot be read is
dropped with its reason, a named one stops the check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from stepscope.analysis.regression.gate import (
    METRICS,
    CheckConfig,
    CheckResult,
    DroppedBaseline,
    JobData,
    check_regression,
)
from stepscope.api.goodput_read import GoodputRead
from stepscope.check.files import read_steps_files
from stepscope.client import JobStore, StoreError
from stepscope.schema import GOODPUT_CATEGORIES, GOODPUT_METRICS

EXIT_PASS, EXIT_REGRESSION, EXIT_USAGE, EXIT_INCONCLUSIVE = 0, 1, 2, 3
FAIL_ON = ("regression", "any", "never")
DEFAULT_LAST = 10
"""Baselines from history: this many last finished jobs, unless --last says otherwise."""


class UsageError(Exception):
    """Wrong or conflicting options; exit 2."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    """The jobs a check's options name: a candidate (stored or files) and its baselines."""

    job_id: str | None = None
    """The candidate, a stored job (or else candidate_steps)."""
    candidate_steps: Sequence[Path] = ()
    """The candidate's steps files, one job per file or per job_id in it (re-runs)."""
    baseline: Sequence[str] = ()
    """Stored baseline jobs, by id."""
    baseline_steps: Sequence[Path] = ()
    """Baseline jobs' steps files."""
    baseline_key: str | None = None
    """Benchmark key of the history (default: the candidate's)."""
    last: int | None = None
    """Baselines from history: the last N finished jobs (default DEFAULT_LAST)."""
    peak_flops: float | None = None
    """Peak FLOP/s per device, for the MFU of steps files."""

    def __post_init__(self) -> None:
        if (self.job_id is None) == (not self.candidate_steps):
            raise UsageError(
                "give a candidate: a stored JOB_ID or --candidate-steps FILE, not both"
            )
        if self.last is not None and self.last < 1:
            raise UsageError("--last must be >= 1")
        if self.from_history and self.job_id is None and self.baseline_key is None:
            raise UsageError(
                "no baseline: give --baseline-steps FILE, or --baseline JOB_ID or "
                "--baseline-key KEY with --db or --url"
            )

    @property
    def from_history(self) -> bool:
        """Whether the baselines are the key's last jobs (none are named)."""
        return not self.baseline and not self.baseline_steps

    @property
    def needs_store(self) -> bool:
        """Whether a stored job is read (else files alone are compared)."""
        return self.job_id is not None or bool(self.baseline) or self.from_history


@dataclass(kw_only=True, slots=True)
class Jobs:
    """What a check compares, read."""

    candidates: list[JobData]
    baselines: list[JobData]
    unusable: list[DroppedBaseline] = field(default_factory=list)
    """History jobs that could not be read (not rolled up yet)."""
    notes: list[str] = field(default_factory=list)
    benchmark_key: str | None = None
    source: str = "files"
    """Where the stored jobs were read, for the verdict."""


def check_config(
    metrics: Sequence[str] | None, *, alpha: float, min_effect: float, warmup: str
) -> CheckConfig:
    """The gate's statistics settings from the options (warmup: a number of steps or auto)."""
    unknown = [m for m in metrics or () if m not in METRICS and m not in GOODPUT_METRICS]
    if unknown:
        raise UsageError(
            f"unknown --metric {', '.join(unknown)}; choose from {', '.join(METRICS)}, "
            f"{', '.join(GOODPUT_METRICS)}"
        )
    if warmup == "auto":
        warmup_steps = None
    elif warmup.isdigit():
        warmup_steps = int(warmup)
    else:
        raise UsageError(f"--warmup-steps must be a number of steps or auto; got {warmup!r}")
    try:
        return CheckConfig(
            metrics=tuple(dict.fromkeys(metrics)) if metrics else METRICS,
            alpha=alpha,
            min_effect=min_effect,
            warmup_steps=warmup_steps,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def wants_goodput(config: CheckConfig) -> bool:
    """Whether the check tests a goodput share (the stored jobs' goodput is then read)."""
    return any(m in GOODPUT_METRICS for m in config.metrics)


def goodput_shares(answer: GoodputRead) -> dict[str, float] | None:
    """GOODPUT_METRICS → the job's shares of its GPU-time; None when it has none yet."""
    if answer.total_gpu_s <= 0:
        return None
    badput = {f"badput_{c}": answer.categories[c].share for c in GOODPUT_CATEGORIES[1:]}
    return {"goodput": answer.goodput, **badput}


def load_jobs(selection: Selection, store: JobStore | None, *, with_goodput: bool = False) -> Jobs:
    """The candidate run(s) and baselines of the selection, read from the store and files;
    `with_goodput` reads the stored jobs' goodput too (steps files have none).

    Raises StoreError (a named job is missing or not rolled up) or StepsFileError.
    """
    if selection.needs_store and store is None:
        raise ValueError("this selection reads stored jobs: pass a store")
    key = selection.baseline_key
    started_before = None
    notes = []
    if selection.job_id is not None:
        assert store is not None
        info = store.summary(selection.job_id)
        candidates = [_gate_data(store, selection.job_id, with_goodput)]
        key = key or info.benchmark_key
        started_before = info.started_at
        if info.status != "finished":
            notes.append(f"the candidate {selection.job_id} is {info.status}, not finished")
    else:
        candidates = read_steps_files(selection.candidate_steps, peak_flops=selection.peak_flops)
    ids = list(selection.baseline)
    if selection.from_history:
        if key is None:
            raise UsageError(
                "no baseline: the candidate has no benchmark_key; give --baseline-key, "
                "--baseline JOB_ID or --baseline-steps FILE"
            )
        assert store is not None
        ids = store.history(
            key,
            last=selection.last or DEFAULT_LAST,
            started_before=started_before,
            exclude=[c.job_id for c in candidates],
        )
    baselines, unusable = [], []
    for baseline_id in ids:
        assert store is not None
        try:
            baselines.append(_gate_data(store, baseline_id, with_goodput))
        except StoreError as exc:
            if not selection.from_history:  # a job the user named: say so and stop
                raise
            unusable.append(DroppedBaseline(job_id=baseline_id, reason=str(exc)))
    baselines += read_steps_files(selection.baseline_steps, peak_flops=selection.peak_flops)
    return Jobs(
        candidates=candidates,
        baselines=baselines,
        unusable=unusable,
        notes=notes,
        benchmark_key=key,
        source=store.where if store is not None else "files",
    )


def _gate_data(store: JobStore, job_id: str, with_goodput: bool) -> JobData:
    data = store.gate_data(job_id)
    if not with_goodput:
        return data
    return replace(data, goodput=goodput_shares(store.goodput(job_id)))


def compare(jobs: Jobs, config: CheckConfig) -> CheckResult:
    """The verdict on the candidates against the baselines."""
    return check_regression(
        jobs.candidates, jobs.baselines, config, unusable=jobs.unusable, notes=jobs.notes
    )


def checked_fail_on(fail_on: str) -> str:
    """`fail_on` if it is one of FAIL_ON."""
    if fail_on not in FAIL_ON:
        raise UsageError(f"--fail-on must be one of {', '.join(FAIL_ON)}; got {fail_on!r}")
    return fail_on


def exit_code(result: CheckResult, *, fail_on: str, allow_missing_baseline: bool) -> int:
    """0 pass, 1 regression (or, with fail_on any, inconclusive), 3 inconclusive or not
    enough baseline (0 with allow_missing_baseline); fail_on never: always 0."""
    if fail_on == "never" or result.outcome == "pass":
        return EXIT_PASS
    if result.outcome == "regression":
        return EXIT_REGRESSION
    if fail_on == "any" and not result.baseline_missing:
        return EXIT_REGRESSION
    return EXIT_PASS if allow_missing_baseline else EXIT_INCONCLUSIVE
