"""The `stepscope` command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

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
    from stepscope.api.settings import Settings

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
) -> None:
    """Run the collector, API and dashboard as one server."""
    import uvicorn

    from stepscope.api.app import create_app
    from stepscope.api.settings import Settings, check_exposure
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
    settings = Settings(**overrides)  # type: ignore[arg-type]
    try:
        check_exposure(settings)
        application = create_app(settings)
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
    from stepscope.api.auth import SCOPES
    from stepscope.store import queries
    from stepscope.store.engine import make_engine
    from stepscope.store.migrate import ensure_current

    unknown = sorted(set(scope) - set(SCOPES))
    if unknown:
        raise fail(f"unknown scope(s) {', '.join(unknown)}; choose from {', '.join(SCOPES)}")
    engine = make_engine(_database_url(db))
    ensure_current(engine, auto_upgrade=engine.dialect.name == "sqlite")
    typer.echo(queries.create_token(engine, name=name or "+".join(scope), scopes=scope))


def _parse_straggler(text: str) -> Any:
    """RANK[,RANK…]:FACTOR:FROM_STEP[:CAUSE[:UNTIL_STEP]] → synth.Straggler."""
    from stepscope.synth import Straggler

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

    from stepscope.simulate import stream_job
    from stepscope.synth import JobSpec, generate

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
    import orjson
    from rich.table import Table

    if output == "json":
        typer.echo(
            orjson.dumps([f.to_dict() for f in findings], option=orjson.OPT_INDENT_2).decode()
        )
        return
    table = Table(
        "kind", "severity", "ranks", "node", "steps", "cause", "metric", "effect", "evidence"
    )
    for f in findings:
        steps = (
            f"{f.first_step}–{'' if f.last_step is None else f.last_step}"
            if f.first_step is not None
            else ""
        )
        effect = "" if f.effect is None else f"{f.effect:+.1%}"
        table.add_row(
            f.kind,
            f.severity,
            ",".join(map(str, f.ranks)),
            f.node or "",
            steps,
            f.cause or "",
            f.metric or "",
            effect,
            str(f.evidence)[:80],
        )
    Console().print(table if findings else "no findings")


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
    output: Annotated[str, typer.Option("--format", help="table or json")] = "table",
    full: Annotated[
        bool, typer.Option("--full", help="Stored job: rebuild rollups and findings from scratch")
    ] = False,
) -> None:
    """Find stragglers, stalls, slow collectives and throughput drops in a job."""
    if output not in ("table", "json"):
        raise fail("--format must be table or json")
    if (job_id is None) == (steps_file is None):
        raise fail("give either a JOB_ID (stored job) or --steps FILE (offline), not both")
    if job_id is not None:
        from stepscope.api.analyzer import RawRowsPrunedError, analyze_stored_job
        from stepscope.store.engine import make_engine
        from stepscope.store.queries import load_job

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
    from stepscope.demo import run_demo

    run_demo(
        database_url=_database_url(db),
        port=port,
        num_ranks=ranks,
        num_steps=steps,
        keep_serving=not exit_after,
        print_findings=lambda f: _print_findings(f, "table"),
        say=Console().print,
    )


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":
    main()
