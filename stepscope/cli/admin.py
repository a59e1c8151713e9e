"""`stepscope db upgrade|prune` and `stepscope token create`: the database's schema, retention
and API tokens."""

from __future__ import annotations

from typing import Annotated

import typer

from stepscope.cli.options import DbOption, database_url, fail, stderr

db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
token_app = typer.Typer(no_args_is_help=True, help="API tokens.")


@db_app.command("upgrade")
def db_upgrade(db: DbOption = None) -> None:
    """Apply all migrations to the database."""
    from stepscope.store.engine import make_engine
    from stepscope.store.migrate import current_revision, upgrade

    engine = make_engine(database_url(db))
    upgrade(engine)
    stderr.print(f"database at revision {current_revision(engine)}")


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

    engine = make_engine(database_url(db))
    ensure_current(engine, auto_upgrade=engine.dialect.name == "sqlite")
    result = prune(engine, before=time.time() - _duration_s(older_than), keep_rollups=keep_rollups)
    rows = sum(result.deleted_rows.values())
    what = "raw rows of" if keep_rollups else "everything about"
    stderr.print(f"pruned {what} {len(result.job_ids)} job(s): {rows} rows deleted")


@token_app.command("create")
def token_create(
    scope: Annotated[list[str], typer.Option("--scope", help="ingest, read or admin (repeatable)")],
    name: Annotated[str, typer.Option("--name", help="What the token is for")] = "",
    db: DbOption = None,
) -> None:
    """Create a token and print it once; only its hash is stored."""
    from stepscope.schema import SCOPES
    from stepscope.store import tokens
    from stepscope.store.engine import make_engine
    from stepscope.store.migrate import ensure_current

    unknown = sorted(set(scope) - set(SCOPES))
    if unknown:
        raise fail(f"unknown scope(s) {', '.join(unknown)}; choose from {', '.join(SCOPES)}")
    engine = make_engine(database_url(db))
    ensure_current(engine, auto_upgrade=engine.dialect.name == "sqlite")
    typer.echo(tokens.create_token(engine, name=name or "+".join(scope), scopes=scope))
