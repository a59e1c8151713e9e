"""The `stepscope` command line."""

from __future__ import annotations

import os
from typing import Annotated

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


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":
    main()
