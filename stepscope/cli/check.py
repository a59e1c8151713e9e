"""`stepscope check` (the CI regression gate) and `stepscope report JOB --html` commands.

`register(app)` adds both to the stepscope CLI. Exit codes of check: 0 pass, 1 regression,
2 usage or configuration error, 3 not enough baseline or inconclusive.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

if TYPE_CHECKING:
    from stepscope.analysis.regression import CheckConfig, CheckResult, DroppedBaseline, JobData
    from stepscope.check.sources import JobSource

EXIT_PASS, EXIT_REGRESSION, EXIT_USAGE, EXIT_INCONCLUSIVE = 0, 1, 2, 3
FAIL_ON = ("regression", "any", "never")

_errors = Console(stderr=True)

DbOpt = Annotated[
    str | None,
    typer.Option("--db", help="Database URL (default: $STEPSCOPE_DATABASE_URL or ./stepscope.db)"),
]
UrlOpt = Annotated[
    str | None, typer.Option("--url", help="Read stored jobs from this stepscope server instead")
]
TokenOpt = Annotated[
    str | None, typer.Option("--token", envvar="STEPSCOPE_TOKEN", help="Bearer token (read)")
]
BaselineOpt = Annotated[
    list[str] | None, typer.Option("--baseline", help="A baseline job id (repeatable)")
]
BaselineStepsOpt = Annotated[
    list[Path] | None,
    typer.Option("--baseline-steps", help="A baseline job's steps parquet/CSV (repeatable)"),
]
BaselineKeyOpt = Annotated[
    str | None,
    typer.Option("--baseline-key", help="Benchmark key of the history (default: the candidate's)"),
]
LastOpt = Annotated[
    int | None, typer.Option("--last", help="Baselines: the last N finished jobs (default 10)")
]
MetricOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--metric",
        help="step_s, tokens_per_s, mfu, data_s, compute_s or comm_wait_s (repeatable; "
        "default all)",
    ),
]
AlphaOpt = Annotated[float, typer.Option("--alpha", help="False-fail rate over all metrics tested")]
MinEffectOpt = Annotated[
    float, typer.Option("--min-effect", help="Smallest slowdown that fails (0.02 = 2%)")
]
WarmupOpt = Annotated[
    str, typer.Option("--warmup-steps", help="Leading steps ignored per job: N or auto")
]
PeakOpt = Annotated[
    float | None,
    typer.Option("--peak-flops", help="Peak FLOP/s per device, for MFU of steps files"),
]


class UsageError(Exception):
    """Wrong or conflicting options; exit 2."""


def _fail(message: str) -> typer.Exit:
    _errors.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(EXIT_USAGE)


@dataclass(kw_only=True, slots=True)
class _Jobs:
    candidates: list[JobData]
    baselines: list[JobData]
    unusable: list[DroppedBaseline]
    """History jobs that could not be read (not rolled up yet)."""
    notes: list[str]
    benchmark_key: str | None
    source: str


def _config(metrics: list[str] | None, alpha: float, min_effect: float, warmup: str) -> CheckConfig:
    from stepscope.analysis.regression import METRICS, CheckConfig

    unknown = [m for m in metrics or () if m not in METRICS]
    if unknown:
        raise UsageError(f"unknown --metric {', '.join(unknown)}; choose from {', '.join(METRICS)}")
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


def _store(db: str | None, url: str | None, token: str | None) -> JobSource:
    from stepscope.check.sources import ApiSource, DbSource

    if db and url:
        raise UsageError("give --db or --url, not both")
    if url:
        return ApiSource(url, token)
    if not db:
        from stepscope.server.settings import Settings

        db = os.environ.get("STEPSCOPE_DATABASE_URL") or Settings().database_url
    return DbSource(db)


def _load_jobs(
    job_id: str | None,
    *,
    db: str | None,
    url: str | None,
    token: str | None,
    candidate_steps: list[Path],
    baseline: list[str],
    baseline_steps: list[Path],
    baseline_key: str | None,
    last: int | None,
    peak_flops: float | None,
) -> _Jobs:
    """The candidate run(s) and the baselines the options name."""
    from stepscope.analysis.regression import DroppedBaseline
    from stepscope.check.sources import SourceError, read_steps_files

    if (job_id is None) == (not candidate_steps):
        raise UsageError("give a candidate: a stored JOB_ID or --candidate-steps FILE, not both")
    if last is not None and last < 1:
        raise UsageError("--last must be >= 1")
    from_history = not baseline and not baseline_steps
    if from_history and job_id is None and baseline_key is None:
        raise UsageError(
            "no baseline: give --baseline-steps FILE, or --baseline JOB_ID or --baseline-key KEY "
            "with --db or --url"
        )
    store = _store(db, url, token) if job_id or baseline or from_history else None
    where = store.where if store else "files"
    key = baseline_key
    started_before = None
    notes = []
    if job_id is not None:
        assert store is not None
        info = store.info(job_id)
        candidates = [store.data(job_id)]
        key = key or info.benchmark_key
        started_before = info.started_at
        if info.status != "finished":
            notes.append(f"the candidate {job_id} is {info.status}, not finished")
    else:
        candidates = read_steps_files(candidate_steps, peak_flops=peak_flops)
    ids = list(baseline)
    if from_history:
        if key is None:
            raise UsageError(
                "no baseline: the candidate has no benchmark_key; give --baseline-key, "
                "--baseline JOB_ID or --baseline-steps FILE"
            )
        assert store is not None
        ids = store.history(
            key,
            last=last or 10,
            started_before=started_before,
            exclude=[c.job_id for c in candidates],
        )
    baselines, unusable = [], []
    for baseline_id in ids:
        assert store is not None
        try:
            baselines.append(store.data(baseline_id))
        except SourceError as exc:
            if not from_history:  # a job the user named: say so and stop
                raise
            unusable.append(DroppedBaseline(job_id=baseline_id, reason=str(exc)))
    baselines += read_steps_files(baseline_steps, peak_flops=peak_flops)
    return _Jobs(
        candidates=candidates,
        baselines=baselines,
        unusable=unusable,
        notes=notes,
        benchmark_key=key,
        source=where,
    )


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


def check(
    job_id: Annotated[str | None, typer.Argument(help="The candidate: a stored job id")] = None,
    db: DbOpt = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    candidate_steps: Annotated[
        list[Path] | None,
        typer.Option("--candidate-steps", help="Candidate steps parquet/CSV (repeatable: re-runs)"),
    ] = None,
    baseline: BaselineOpt = None,
    baseline_steps: BaselineStepsOpt = None,
    baseline_key: BaselineKeyOpt = None,
    last: LastOpt = None,
    metric: MetricOpt = None,
    alpha: AlphaOpt = 0.01,
    min_effect: MinEffectOpt = 0.02,
    warmup_steps: WarmupOpt = "auto",
    fail_on: Annotated[
        str,
        typer.Option("--fail-on", help="What fails: regression, any (also inconclusive), never"),
    ] = "regression",
    allow_missing_baseline: Annotated[
        bool, typer.Option("--allow-missing-baseline", help="Exit 0 instead of 3")
    ] = False,
    json_file: Annotated[
        Path | None, typer.Option("--json", help="Write the verdict as JSON")
    ] = None,
    junit_file: Annotated[Path | None, typer.Option("--junit", help="Write JUnit XML")] = None,
    markdown_file: Annotated[
        Path | None, typer.Option("--markdown", help="Write a Markdown summary")
    ] = None,
    peak_flops: PeakOpt = None,
) -> None:
    """Fail CI when a job is slower than its baselines: exit 0 pass, 1 regression, 2 usage
    error, 3 not enough baseline or inconclusive."""
    from stepscope.analysis.regression import check_regression
    from stepscope.check import outputs
    from stepscope.check.sources import SourceError

    try:
        if fail_on not in FAIL_ON:
            raise UsageError(f"--fail-on must be one of {', '.join(FAIL_ON)}; got {fail_on!r}")
        config = _config(metric, alpha, min_effect, warmup_steps)
        jobs = _load_jobs(
            job_id,
            db=db,
            url=url,
            token=token,
            candidate_steps=candidate_steps or [],
            baseline=baseline or [],
            baseline_steps=baseline_steps or [],
            baseline_key=baseline_key,
            last=last,
            peak_flops=peak_flops,
        )
    except (UsageError, SourceError) as exc:
        raise _fail(str(exc)) from None
    result = check_regression(
        jobs.candidates, jobs.baselines, config, unusable=jobs.unusable, notes=jobs.notes
    )
    code = exit_code(result, fail_on=fail_on, allow_missing_baseline=allow_missing_baseline)
    context = outputs.Context(
        benchmark_key=jobs.benchmark_key, source=jobs.source, fail_on=fail_on, exit_code=code
    )
    Console(width=80, highlight=False).print(outputs.terminal(result, context))
    markdown = outputs.to_markdown(result, context)
    try:
        if json_file:
            json_file.write_bytes(outputs.to_json(result, context))
        if junit_file:
            junit_file.write_bytes(outputs.to_junit(result, context))
        if markdown_file:
            markdown_file.write_text(markdown, encoding="utf-8")
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary:
            with open(summary, "a", encoding="utf-8") as f:
                f.write(markdown + "\n")
    except OSError as exc:
        raise _fail(f"cannot write the report: {exc}") from None
    if os.environ.get("GITHUB_ACTIONS") == "true":
        for command in outputs.github_annotations(result):
            typer.echo(command)
    raise typer.Exit(code)


def report(
    job_id: Annotated[str, typer.Argument(help="A stored job id")],
    html_file: Annotated[Path, typer.Option("--html", help="Write a self-contained HTML report")],
    db: DbOpt = None,
    baseline: BaselineOpt = None,
    baseline_steps: BaselineStepsOpt = None,
    baseline_key: BaselineKeyOpt = None,
    last: LastOpt = None,
    metric: MetricOpt = None,
    alpha: AlphaOpt = 0.01,
    min_effect: MinEffectOpt = 0.02,
    warmup_steps: WarmupOpt = "auto",
    peak_flops: PeakOpt = None,
) -> None:
    """Write one self-contained HTML file about a stored job: summary, step time, throughput
    and MFU, ranks, findings, and the check verdict when baselines are given."""
    from stepscope.analysis.regression import check_regression
    from stepscope.check.sources import DbSource, SourceError
    from stepscope.report.collect import collect
    from stepscope.report.html import render

    verdict: CheckResult | None = None
    try:
        store = _store(db, None, None)
        assert isinstance(store, DbSource)
        store.info(job_id)
        if baseline or baseline_steps or baseline_key or last:
            config = _config(metric, alpha, min_effect, warmup_steps)
            jobs = _load_jobs(
                job_id,
                db=db,
                url=None,
                token=None,
                candidate_steps=[],
                baseline=baseline or [],
                baseline_steps=baseline_steps or [],
                baseline_key=baseline_key,
                last=last,
                peak_flops=peak_flops,
            )
            verdict = check_regression(
                jobs.candidates, jobs.baselines, config, unusable=jobs.unusable, notes=jobs.notes
            )
        data = collect(store.engine, job_id, verdict)
    except (UsageError, SourceError) as exc:
        raise _fail(str(exc)) from None
    try:
        html_file.write_text(render(data), encoding="utf-8")
    except OSError as exc:
        raise _fail(f"cannot write {html_file}: {exc}") from None
    Console(stderr=True, highlight=False).print(f"report of {job_id} written to {html_file}")


def register(app: typer.Typer) -> None:
    """Add the check and report commands to the stepscope CLI."""
    app.command("check")(check)
    app.command("report")(report)
