"""`stepscope check` (the CI regression gate) and `stepscope report JOB --html`.

Exit codes of check: 0 pass, 1 regression, 2 usage or configuration error, 3 not enough
baseline or inconclusive (the policy is stepscope.check.plan's).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from stepscope.cli.options import (
    DbOption,
    TokenOption,
    UrlOption,
    fail,
    open_database,
    open_store,
    stderr,
)

if TYPE_CHECKING:
    from stepscope.analysis.regression.gate import CheckResult

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
        "default all of these), or a goodput share: goodput, badput_<category> "
        "(badput_hang, badput_restart_downtime, ...)",
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


def check(
    job_id: Annotated[str | None, typer.Argument(help="The candidate: a stored job id")] = None,
    db: DbOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
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
    from stepscope.check import outputs, plan
    from stepscope.check.files import StepsFileError
    from stepscope.client import StoreError

    try:
        plan.checked_fail_on(fail_on)
        config = plan.check_config(metric, alpha=alpha, min_effect=min_effect, warmup=warmup_steps)
        selection = plan.Selection(
            job_id=job_id,
            candidate_steps=candidate_steps or (),
            baseline=baseline or (),
            baseline_steps=baseline_steps or (),
            baseline_key=baseline_key,
            last=last,
            peak_flops=peak_flops,
        )
        store = open_store(db, url, token) if selection.needs_store else None
        try:
            jobs = plan.load_jobs(selection, store, with_goodput=plan.wants_goodput(config))
        finally:
            if store is not None:
                store.close()
    except (plan.UsageError, StoreError, StepsFileError) as exc:
        raise fail(str(exc)) from None
    result = plan.compare(jobs, config)
    code = plan.exit_code(result, fail_on=fail_on, allow_missing_baseline=allow_missing_baseline)
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
        raise fail(f"cannot write the report: {exc}") from None
    if os.environ.get("GITHUB_ACTIONS") == "true":
        for command in outputs.github_annotations(result):
            typer.echo(command)
    raise typer.Exit(code)


def report(
    job_id: Annotated[str, typer.Argument(help="A stored job id")],
    html_file: Annotated[Path, typer.Option("--html", help="Write a self-contained HTML report")],
    db: DbOption = None,
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
    from stepscope.check import plan
    from stepscope.check.files import StepsFileError
    from stepscope.client import StoreError
    from stepscope.report.collect import collect
    from stepscope.report.html import render

    verdict: CheckResult | None = None
    store = open_database(db)
    try:
        store.summary(job_id)
        if baseline or baseline_steps or baseline_key or last:
            config = plan.check_config(
                metric, alpha=alpha, min_effect=min_effect, warmup=warmup_steps
            )
            selection = plan.Selection(
                job_id=job_id,
                baseline=baseline or (),
                baseline_steps=baseline_steps or (),
                baseline_key=baseline_key,
                last=last,
                peak_flops=peak_flops,
            )
            jobs = plan.load_jobs(selection, store, with_goodput=plan.wants_goodput(config))
            verdict = plan.compare(jobs, config)
        data = collect(store.engine, job_id, verdict)
    except (plan.UsageError, StoreError, StepsFileError) as exc:
        raise fail(str(exc)) from None
    finally:
        store.close()
    try:
        html_file.write_text(render(data), encoding="utf-8")
    except OSError as exc:
        raise fail(f"cannot write {html_file}: {exc}") from None
    stderr.print(f"report of {job_id} written to {html_file}")
