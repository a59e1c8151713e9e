"""The `stepscope` command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from stepscope.cli import check as check_cli

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="stepscope: training performance observability"
)
db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
token_app = typer.Typer(no_args_is_help=True, help="API tokens.")
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")

console = Console(stderr=True)

DbOption = Annotated[
    str | None,
    typer.Option("--db", help="Database URL (default: $STEPSCOPE_DATABASE_URL or ./stepscope.db)"),
]


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print an expected error without a traceback; raise the returned Exit."""
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def _database_url(db: str | None) -> str:
    from stepscope.server.settings import Settings

    return db or Settings().database_url


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = 8000,
    db: DbOption = None,
    auth: Annotated[
        bool | None, typer.Option("--auth/--no-auth", help="Require bearer tokens")
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option("--allow-unauthenticated", help="Allow a non-loopback address without auth"),
    ] = False,
    analyze_interval_s: Annotated[
        float | None,
        typer.Option("--analyze-interval", help="Seconds between re-analyses; 0 = off"),
    ] = None,
    webhook: Annotated[
        list[str] | None,
        typer.Option(
            "--webhook",
            help="POST new warning/critical findings here (repeatable; adds to "
            "$STEPSCOPE_WEBHOOK_URLS)",
        ),
    ] = None,
) -> None:
    """Run the collector, API and dashboard as one server."""
    import uvicorn
    from pydantic import ValidationError

    from stepscope.server.app import create_app
    from stepscope.server.settings import Settings, check_exposure
    from stepscope.store.migrate import SchemaOutdatedError

    overrides: dict[str, object] = {"host": host, "port": port}
    if db:
        overrides["database_url"] = db
    if auth is not None:
        overrides["auth"] = auth
    if allow_unauthenticated:
        overrides["allow_unauthenticated"] = True
    if analyze_interval_s is not None:
        overrides["analyze_interval_s"] = analyze_interval_s
    try:
        if webhook:
            overrides["webhook_urls"] = [*Settings().webhook_urls, *webhook]
        settings = Settings(**overrides)  # type: ignore[arg-type]
        check_exposure(settings)
        application = create_app(settings)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise fail("; ".join(problems)) from None
    except (ValueError, SchemaOutdatedError) as exc:
        raise fail(str(exc)) from None
    console.print(f"stepscope serving on http://{host}:{port} (database: {settings.database_url})")
    uvicorn.run(application, host=host, port=port, log_level="warning", access_log=False)


@db_app.command("upgrade")
def db_upgrade(db: DbOption = None) -> None:
    """Apply all migrations to the database."""
    from stepscope.store.engine import make_engine
    from stepscope.store.migrate import current_revision, upgrade

    engine = make_engine(_database_url(db))
    upgrade(engine)
    console.print(f"database at revision {current_revision(engine)}")


_DURATION_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _duration_s(text: str) -> float:
    """'30d', '12h', '90m', '45s' or '2w' in seconds."""
    number, unit = text[:-1], text[-1:].lower()
    try:
        if unit not in _DURATION_UNITS_S or float(number) < 0:
            raise ValueError
        return float(number) * _DURATION_UNITS_S[unit]
    except ValueError:
        raise fail(
            f"bad duration {text!r}: expected a number and a unit, e.g. 30d, 12h, 90m"
        ) from None


@db_app.command("prune")
def db_prune(
    older_than: Annotated[
        str, typer.Option("--older-than", help="Age of the jobs to prune: 30d, 12h, 90m…")
    ],
    keep_rollups: Annotated[
        bool,
        typer.Option(
            "--keep-rollups", help="Delete only raw rows; keep summaries, rollups and findings"
        ),
    ] = False,
    db: DbOption = None,
) -> None:
    """Delete jobs finished (or silent) for longer than --older-than."""
    import time

    from stepscope.store.engine import make_engine
    from stepscope.store.migrate import ensure_current
    from stepscope.store.retention import prune

    engine = make_engine(_database_url(db))
    ensure_current(engine, auto_upgrade=engine.dialect.name == "sqlite")
    result = prune(engine, before=time.time() - _duration_s(older_than), keep_rollups=keep_rollups)
    rows = sum(result.deleted_rows.values())
    what = "raw rows of" if keep_rollups else "everything about"
    console.print(f"pruned {what} {len(result.job_ids)} job(s): {rows} rows deleted")


@token_app.command("create")
def token_create(
    scope: Annotated[list[str], typer.Option("--scope", help="ingest, read or admin (repeatable)")],
    name: Annotated[str, typer.Option("--name", help="What the token is for")] = "",
    db: DbOption = None,
) -> None:
    """Create a token and print it once; only its hash is stored."""
    from stepscope.server.auth import SCOPES
    from stepscope.store import tokens
    from stepscope.store.engine import make_engine
    from stepscope.store.migrate import ensure_current

    unknown = sorted(set(scope) - set(SCOPES))
    if unknown:
        raise fail(f"unknown scope(s) {', '.join(unknown)}; choose from {', '.join(SCOPES)}")
    engine = make_engine(_database_url(db))
    ensure_current(engine, auto_upgrade=engine.dialect.name == "sqlite")
    typer.echo(tokens.create_token(engine, name=name or "+".join(scope), scopes=scope))


def _parse_straggler(text: str) -> Any:
    """RANK[,RANK…]:FACTOR:FROM_STEP[:CAUSE[:UNTIL_STEP]] → synth.Straggler."""
    from stepscope.synthetic.generate import Straggler

    parts = text.split(":")
    try:
        ranks = tuple(int(r) for r in parts[0].split(","))
        factor, from_step = float(parts[1]), int(parts[2])
        cause = parts[3] if len(parts) > 3 else "compute"
        until = int(parts[4]) if len(parts) > 4 else None
        return Straggler(
            ranks=ranks,
            factor=factor,
            cause=cause,  # type: ignore[arg-type]  # checked by Straggler
            from_step=from_step,
            until_step=until,
        )
    except (IndexError, ValueError) as exc:
        raise fail(
            f"bad --straggler {text!r} ({exc}); "
            "expected RANK:FACTOR:FROM_STEP[:CAUSE[:UNTIL_STEP]], e.g. 3:1.3:100:compute"
        ) from None


@app.command()
def simulate(
    ranks: Annotated[int, typer.Option("--ranks", help="World size")] = 8,
    steps: Annotated[int, typer.Option("--steps", help="Training steps")] = 500,
    url: Annotated[str, typer.Option("--url", envvar="STEPSCOPE_URL")] = "http://127.0.0.1:8000",
    token: Annotated[str | None, typer.Option("--token", envvar="STEPSCOPE_TOKEN")] = None,
    job_id: Annotated[str | None, typer.Option("--job-id")] = None,
    straggler: Annotated[
        list[str] | None,
        typer.Option(
            "--straggler",
            help="RANK:FACTOR:FROM_STEP[:CAUSE[:UNTIL_STEP]], repeatable; "
            "CAUSE is data, compute (default), communication or gpu_throttling",
        ),
    ] = None,
    step_time_s: Annotated[
        float, typer.Option("--step-time", help="Clean step time, seconds")
    ] = 0.5,
    steps_per_s: Annotated[
        float | None,
        typer.Option("--rate", help="Pace to this many steps/s (default: as fast as possible)"),
    ] = None,
    steps_per_batch: Annotated[int, typer.Option("--steps-per-batch")] = 10,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Stream a realistic synthetic job to a collector through the wire protocol."""
    import time

    from stepscope.synthetic.generate import JobSpec, generate
    from stepscope.synthetic.stream import stream_job

    spec = JobSpec(
        job_id=job_id or f"sim-{int(time.time())}",
        num_ranks=ranks,
        num_steps=steps,
        base_step_s=step_time_s,
        stragglers=tuple(_parse_straggler(s) for s in straggler or ()),
        start_ts=time.time(),
        seed=seed,
    )
    stats = stream_job(
        generate(spec), url, token=token, steps_per_batch=steps_per_batch, steps_per_s=steps_per_s
    )
    if stats.failures:
        raise fail(f"{len(stats.failures)} batch(es) failed, first: {stats.failures[0]}", code=1)
    console.print(
        f"job {spec.job_id}: {stats.batches} batches, {stats.rows} rows in {stats.elapsed_s:.1f} s"
    )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    job_id: Annotated[str | None, typer.Option("--job-id", envvar="STEPSCOPE_JOB_ID")] = None,
    url: Annotated[str | None, typer.Option("--url", envvar="STEPSCOPE_URL")] = None,
    token: Annotated[str | None, typer.Option("--token", envvar="STEPSCOPE_TOKEN")] = None,
) -> None:
    """Run a training command (e.g. torchrun …) with the job's stepscope environment: run -- CMD…"""
    from stepscope.profiler.launcher import launch

    if not ctx.args:
        raise fail("no command given; usage: stepscope run [--job-id ID] -- CMD…")
    raise typer.Exit(launch(ctx.args, job_id=job_id, url=url, token=token))


def _print_findings(findings: list[Any], output: str) -> None:
    """Findings one readable line each, or as JSON."""
    import orjson

    from stepscope.cli.output import print_finding_lines

    if output == "json":
        typer.echo(
            orjson.dumps([f.to_dict() for f in findings], option=orjson.OPT_INDENT_2).decode()
        )
        return
    print_finding_lines(findings)


@app.command()
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
    output: Annotated[str, typer.Option("--format", help="text or json")] = "text",
    full: Annotated[
        bool, typer.Option("--full", help="Stored job: rebuild rollups and findings from scratch")
    ] = False,
) -> None:
    """Find stragglers, stalls, slow collectives and throughput drops in a job."""
    if output not in ("text", "table", "json"):  # "table": the name of text before
        raise fail("--format must be text or json")
    if (job_id is None) == (steps_file is None):
        raise fail("give either a JOB_ID (stored job) or --steps FILE (offline), not both")
    if job_id is not None:
        from stepscope.pipeline.job_pass import RawRowsPrunedError, analyze_stored_job
        from stepscope.store.engine import make_engine
        from stepscope.store.jobs import load_job

        engine = make_engine(_database_url(db))
        if load_job(engine, job_id) is None:
            raise fail(f"no job {job_id!r} in {_database_url(db)}")
        try:
            findings = analyze_stored_job(engine, job_id, full=full)
        except RawRowsPrunedError as exc:
            raise fail(str(exc)) from None
        _print_findings(findings, output)
        return
    if full:
        raise fail("--full re-analyses a stored JOB_ID; offline files are always read in full")
    import polars as pl

    from stepscope.analysis import analyze as run_analysis

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
        findings = run_analysis(steps, collectives=read(collectives_file), gpu=read(gpu_file))
    except (KeyError, ValueError, pl.exceptions.PolarsError) as exc:
        raise fail(f"cannot analyse {steps_file}: {exc}") from None
    _print_findings(findings, output)


@app.command()
def demo(
    port: Annotated[int, typer.Option(help="Port to serve on")] = 8000,
    db: DbOption = None,
    ranks: Annotated[int, typer.Option("--ranks")] = 16,
    steps: Annotated[int, typer.Option("--steps")] = 600,
    exit_after: Annotated[bool, typer.Option("--exit", help="Stop after the analysis")] = False,
) -> None:
    """Serve on SQLite, stream a synthetic job with a straggler into it, and analyse it."""
    from stepscope.synthetic.demo import run_demo

    run_demo(
        database_url=_database_url(db),
        port=port,
        num_ranks=ranks,
        num_steps=steps,
        keep_serving=not exit_after,
        print_findings=lambda f: _print_findings(f, "text"),
        say=Console().print,
    )


# --- reading stored jobs: from a server (--url) or a database (--db) -----------------------

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url", envvar="STEPSCOPE_URL", help="Read from this server (else from the database)"
    ),
]
TokenOption = Annotated[
    str | None, typer.Option("--token", envvar="STEPSCOPE_TOKEN", help="Token with read scope")
]
OutputOption = Annotated[str, typer.Option("--format", help="text or json")]


def _reader(url: str | None, token: str | None, db: str | None) -> Any:
    """A reader of --db if given, else of the server at --url, else of the default database."""
    from stepscope.client import HttpReader, StoreReader, sqlite_path

    if url and not db:
        return HttpReader(url, token)
    from stepscope.store.engine import make_engine
    from stepscope.store.migrate import SchemaOutdatedError, ensure_current

    database_url = _database_url(db)
    path = sqlite_path(database_url)
    if path is not None and not path.is_file():
        raise fail(f"no database at {path}: pass --db URL, or --url of a stepscope server")
    engine = make_engine(database_url)
    try:
        ensure_current(engine, auto_upgrade=False)
    except SchemaOutdatedError as exc:
        raise fail(str(exc)) from None
    return StoreReader(engine)


def _check_output(output: str) -> None:
    if output not in ("text", "json"):
        raise fail(f"--format must be text or json, not {output!r}")


def _reading(url: str | None, token: str | None, db: str | None, read: Any) -> Any:
    """What `read(reader)` returns; a ReadError is printed as an error (exit 1)."""
    from stepscope.client import ReadError

    reader = _reader(url, token, db)
    try:
        return read(reader)
    except ReadError as exc:
        raise fail(str(exc), code=1) from None
    finally:
        reader.close()


@app.command()
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

    _check_output(output)
    request = JobsRequest(
        status=tuple(status or ()),
        benchmark_key=benchmark_key,
        name=name,
        min_severity=min_severity,
        sort=sort,
        cursor=cursor,
        limit=limit,
    )
    page = _reading(url, token, db, lambda r: r.jobs(request))
    if output == "json":
        typer.echo(page.model_dump_json(indent=2))
    else:
        print_jobs(page)


@app.command()
def show(
    job_id: Annotated[str, typer.Argument(help="A stored job")],
    output: OutputOption = "text",
    url: UrlOption = None,
    token: TokenOption = None,
    db: DbOption = None,
) -> None:
    """A job's summary and its findings."""
    from stepscope.cli.output import print_summary

    _check_output(output)
    summary, found = _reading(url, token, db, lambda r: (r.summary(job_id), r.findings(job_id)))
    if output == "json":
        import orjson

        doc = {"summary": summary.model_dump(), "findings": [f.model_dump() for f in found]}
        typer.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        print_summary(summary, found)


@app.command()
def findings(
    job_id: Annotated[str, typer.Argument(help="A stored job")],
    output: OutputOption = "text",
    url: UrlOption = None,
    token: TokenOption = None,
    db: DbOption = None,
) -> None:
    """A job's findings, one readable line each."""
    from stepscope.cli.output import print_finding_lines
    from stepscope.client import findings_json

    _check_output(output)
    found = _reading(url, token, db, lambda r: r.findings(job_id))
    if output == "json":
        typer.echo(findings_json(found))
    else:
        print_finding_lines(found)


@app.command()
def export(
    job_id: Annotated[str, typer.Argument(help="A stored job")],
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

    def write(reader: Any) -> int:
        chunks = reader.export(job_id, table, file_format)
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

    size = _reading(url, token, db, write)
    if str(out) != "-":
        console.print(f"wrote {size:,} bytes of {table} of job {job_id} to {out}")


check_cli.register(app)


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
