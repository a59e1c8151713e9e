"""The options the commands share (--db, --url, --token, --format), opening the store they
name, and `fail`: an expected error printed in one line, without a traceback."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from stepscope.client import JobStore, LocalStore

stderr = Console(stderr=True, highlight=False)
"""Where commands say what they did and what went wrong (stdout carries their output)."""

DbOption = Annotated[
    str | None,
    typer.Option("--db", help="Database URL (default: $STEPSCOPE_DATABASE_URL or ./stepscope.db)"),
]
UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="Read from this stepscope server instead of a database (default: $STEPSCOPE_URL "
        "unless --db is given)",
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="STEPSCOPE_TOKEN", help="Bearer token with the read scope"),
]
OutputOption = Annotated[str, typer.Option("--format", help="text or json")]


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print an expected error without a traceback; raise the returned Exit."""
    stderr.print(f"[bold red]error:[/] {escape(message)}")
    return typer.Exit(code)


def epoch_s(name: str, value: str) -> float:
    """An option's time: epoch seconds, or ISO 8601 (UTC unless it names a zone)."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise fail(
            f"{name} must be epoch seconds or an ISO 8601 time (2026-12-01T00:00); got {value!r}"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def checked_output(output: str) -> str:
    """--format of a read command: text or json."""
    if output not in ("text", "json"):
        raise fail(f"--format must be text or json, not {output!r}")
    return output


def database_url(db: str | None) -> str:
    """--db, else the server's setting ($STEPSCOPE_DATABASE_URL or ./stepscope.db)."""
    from stepscope.server.settings import Settings

    return db or Settings().database_url


def open_database(db: str | None) -> LocalStore:
    """The database --db names, at the latest schema; else exit 2 saying why."""
    from stepscope.client import LocalStore, StoreError

    try:
        return LocalStore.open(database_url(db))
    except StoreError as exc:
        raise fail(str(exc)) from None


def open_store(db: str | None, url: str | None, token: str | None) -> JobStore:
    """The database of --db, else the server of --url (or $STEPSCOPE_URL), else the default
    database; exit 2 if both are given or the database cannot be read."""
    from stepscope.client import RemoteStore

    if db and url:
        raise fail("give --db or --url, not both")
    url = url or (None if db else os.environ.get("STEPSCOPE_URL") or None)
    return RemoteStore(url, token) if url else open_database(db)
