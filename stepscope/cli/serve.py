"""`stepscope serve` (collector, API and dashboard as one server) and `stepscope demo`
(stepscope.demo)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from stepscope.cli.options import DbOption, database_url, fail, stderr


def serve(
    host: Annotated[
        str, typer.Option(envvar="STEPSCOPE_HOST", help="Address to listen on")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="STEPSCOPE_PORT", help="Port to listen on")] = 8000,
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
    from stepscope.server.settings import KEEP_ALIVE_S, Settings, check_exposure
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
    stderr.print(f"stepscope serving on http://{host}:{port} (database: {settings.database_url})")
    uvicorn.run(
        application,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def demo(
    port: Annotated[int, typer.Option(help="Port to serve on")] = 8000,
    db: DbOption = None,
    once: Annotated[
        bool, typer.Option("--once", help="Exit after loading and analysing, instead of serving")
    ] = False,
) -> None:
    """Serve on SQLite, train a real 4-rank FSDP2 job on CPU with trouble injected, say what
    stepscope found, load a 1,024-rank synthetic job and a fleet, and keep serving."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise fail(
            "stepscope demo trains a real job and needs PyTorch: "
            "pip install 'stepscope[torch,server]' (or run `make demo` in a clone)"
        )
    from stepscope.demo.run import DemoError, run_demo

    try:
        run_demo(database_url=database_url(db), port=port, once=once, console=Console())
    except (DemoError, RuntimeError, TimeoutError) as exc:
        raise fail(str(exc), code=1) from None
