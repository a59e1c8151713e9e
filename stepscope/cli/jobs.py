"""Stored jobs: `jobs`, `show`, `findings`, `export` (from a database or a server, alike) and
`analyze` (a stored job, or steps files offline)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from stepscope.cli.options import (
    DbOption,
    OutputOption,
    TokenOption,
    UrlOption,
    checked_output,
    database_url,
    epoch_s,
    fail,
    open_store,
    stderr,
)

if TYPE_CHECKING:
    from stepscope.api.goodput_read import GoodputRead
    from stepscope.client import JobStore

T = TypeVar("T")
JobIdArgument = Annotated[str, typer.Argument(help="A stored job")]


def reading(db: str | None, url: str | None, token: str | None, read: Callable[[JobStore], T]) -> T:
    """What `read(store)` returns from the store the options name; its errors exit 1."""
    from stepscope.client import StoreError

    store = open_store(db, url, token)
    try:
        return read(store)
    except StoreError as exc:
        raise fail(str(exc), code=1) from None
    finally:
        store.close()


def analyze(
    job_id: Annotated[
        str | None, typer.Argument(help="A stored job (reads and updates the store)")
    ] = None,
    db: DbOption = None,
    steps_file: Annotated[
        Path | None, typer.Option("--steps", help="Offline: steps parquet file")
    ] = None,
    collectives_file: Annotated[
        Path | None, typer.Option("--collectives", help="collectives parquet")
    ] = None,
    gpu_file: Annotated[Path | None, typer.Option("--gpu", help="GPU samples parquet")] = None,
    output: OutputOption = "text",
    full: Annotated[
        bool, typer.Option("--full", help="Stored job: rebuild rollups and findings from scratch")
    ] = False,
) -> None:
    """Find stragglers, stalls, slow collectives and throughput drops in a job."""
    from stepscope.cli.output import print_findings

    checked_output(output)
    if (job_id is None) == (steps_file is None):
        raise fail("give either a JOB_ID (stored job) or --steps FILE (offline), not both")
    if job_id is not None:
        from stepscope.pipeline.job_pass import RawRowsPrunedError, analyze_stored_job
        from stepscope.store.engine import make_engine
        from stepscope.store.jobs import load_job

        engine = make_engine(database_url(db))
        if load_job(engine, job_id) is None:
            raise fail(f"no job {job_id!r} in {database_url(db)}")
        try:
            findings = analyze_stored_job(engine, job_id, full=full)
        except RawRowsPrunedError as exc:
            raise fail(str(exc)) from None
        print_findings(findings, output)
        return
    if full:
        raise fail("--full re-analyses a stored JOB_ID; offline files are always read in full")
    import polars as pl

    from stepscope.analysis import analyze as run_analysis
    from stepscope.check.files import StepsFileError, scan_collectives_file

    def read(path: Path | None) -> pl.LazyFrame | None:
        # Lazy: the analysis reads only the columns it uses, and GPU samples only if needed.
        if path is None:
            return None
        if not path.is_file():
            raise fail(f"no such file: {path}")
        return pl.scan_csv(path) if path.suffix == ".csv" else pl.scan_parquet(path)

    steps = read(steps_file)
    assert steps is not None
    try:
        collectives = scan_collectives_file(collectives_file) if collectives_file else None
    except StepsFileError as exc:
        raise fail(str(exc)) from None
    try:
        findings = run_analysis(steps, collectives=collectives, gpu=read(gpu_file))
    except (KeyError, ValueError, pl.exceptions.PolarsError) as exc:
        raise fail(f"cannot analyse {steps_file}: {exc}") from None
    print_findings(findings, output)


def jobs(
    status: Annotated[
        list[str] | None,
        typer.Option("--status", help="running, stale, finished or failed (repeatable)"),
    ] = None,
    benchmark_key: Annotated[str | None, typer.Option("--benchmark-key")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Substring of the name")] = None,
    min_severity: Annotated[
        str | None, typer.Option("--min-severity", help="With a finding of at least this")
    ] = None,
    sort: Annotated[
        str, typer.Option("--sort", help="started_at, name, step_p50_s, mfu…; '-' descends")
    ] = "-started_at",
    limit: Annotated[int, typer.Option("--limit")] = 50,
    cursor: Annotated[str | None, typer.Option("--cursor", help="Next page")] = None,
    output: OutputOption = "text",
    url: UrlOption = None,
    token: TokenOption = None,
    db: DbOption = None,
) -> None:
    """List stored jobs, newest first."""
    from stepscope.cli.output import print_jobs
    from stepscope.client import JobsRequest

    checked_output(output)
    request = JobsRequest(
        status=tuple(status or ()),
        benchmark_key=benchmark_key,
        name=name,
        min_severity=min_severity,
        sort=sort,
        cursor=cursor,
        limit=limit,
    )
    page = reading(db, url, token, lambda r: r.jobs(request))
    if output == "json":
        typer.echo(page.model_dump_json(indent=2))
    else:
        print_jobs(page)


def show(
    job_id: JobIdArgument,
    output: OutputOption = "text",
    url: UrlOption = None,
    token: TokenOption = None,
    db: DbOption = None,
) -> None:
    """A job's summary and its findings."""
    from stepscope.cli.output import goodput_headline, print_summary
    from stepscope.text.findings import WIDTH
    from stepscope.text.fit import clip

    checked_output(output)
    summary, found, goodput = reading(
        db,
        url,
        token,
        lambda r: (r.summary(job_id), r.findings(job_id), _goodput_or_none(r, job_id)),
    )
    if output == "json":
        import orjson

        doc = {
            "summary": summary.model_dump(),
            "findings": [f.model_dump() for f in found],
            "goodput": goodput.model_dump() if goodput is not None else None,
        }
        typer.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        print_summary(summary, found)
        if goodput is not None:
            typer.echo("\n".join(goodput_headline(goodput)))
        hang = next((f for f in found if f.kind == "hang" and "closed_at" not in f.evidence), None)
        if hang is not None:
            e = hang.evidence
            stack = e.get("culprit_stack") or []
            where = f" in {stack[-1]['function']}" if stack else ""
            line = (
                f"HANG for {hang.observed or 0:.0f} s: ranks "
                f"{','.join(map(str, hang.ranks[:8]))} {e['class']} ({e['group']} {e['op']} "
                f"#{e['seq']}){where}"
            )
            typer.echo(clip(line, WIDTH))


def _goodput_or_none(store: JobStore, job_id: str) -> GoodputRead | None:
    """The job's goodput, or None where the store cannot say (a server without the route)."""
    from stepscope.client import StoreError

    try:
        return store.goodput(job_id)
    except StoreError:
        return None


def goodput(
    job_id: Annotated[str | None, typer.Argument(help="A stored job (or --since)")] = None,
    since: Annotated[
        str | None,
        typer.Option("--since", help="All jobs from this time: epoch s or ISO 8601 (UTC)"),
    ] = None,
    until: Annotated[
        str | None, typer.Option("--until", help="...to this time (default: now)")
    ] = None,
    output: OutputOption = "text",
    url: UrlOption = None,
    token: TokenOption = None,
    db: DbOption = None,
) -> None:
    """Where a job's GPU-time went, one line per category; with --since instead of a job,
    where every job's GPU-time in that window went (docs/goodput.md)."""
    from stepscope.cli.output import print_fleet_goodput, print_goodput

    checked_output(output)
    if (job_id is None) == (since is None):
        raise fail("give a JOB, or --since TIME for all jobs in a window (not both)")
    if since is not None:
        start = epoch_s("--since", since)
        end = epoch_s("--until", until) if until is not None else None
        fleet = reading(db, url, token, lambda r: r.fleet_goodput(start, end))
        if output == "json":
            typer.echo(fleet.model_dump_json(indent=2))
        else:
            print_fleet_goodput(fleet)
        return
    assert job_id is not None
    answer = reading(db, url, token, lambda r: r.goodput(job_id))
    if output == "json":
        typer.echo(answer.model_dump_json(indent=2))
    else:
        print_goodput(answer)


def findings(
    job_id: JobIdArgument,
    output: OutputOption = "text",
    url: UrlOption = None,
    token: TokenOption = None,
    db: DbOption = None,
) -> None:
    """A job's findings, one readable line each."""
    from stepscope.cli.output import print_finding_lines
    from stepscope.client import findings_json

    checked_output(output)
    found = reading(db, url, token, lambda r: r.findings(job_id))
    if output == "json":
        typer.echo(findings_json(found))
    else:
        print_finding_lines(found)


def export(
    job_id: JobIdArgument,
    out: Annotated[Path, typer.Option("-o", "--output", help="File to write; - for stdout")],
    table: Annotated[
        str, typer.Option("--table", help="steps, collectives, gpu, events or findings")
    ] = "steps",
    file_format: Annotated[
        str, typer.Option("--format", help="parquet, csv or ndjson")
    ] = "parquet",
    url: UrlOption = None,
    token: TokenOption = None,
    db: DbOption = None,
) -> None:
    """Write a job's records of one table in the canonical columns, streamed."""
    import sys

    def write(store: JobStore) -> int:
        chunks = store.export(job_id, table, file_format)
        if str(out) == "-":
            size = 0
            for chunk in chunks:
                sys.stdout.buffer.write(chunk)
                size += len(chunk)
            sys.stdout.buffer.flush()
            return size
        partial = out.with_name(out.name + ".part")  # a failed export leaves no FILE behind
        size = 0
        with partial.open("wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
        partial.replace(out)
        return size

    size = reading(db, url, token, write)
    if str(out) != "-":
        stderr.print(f"wrote {size:,} bytes of {table} of job {job_id} to {out}")
