"""The typer application: every command but `run`'s implementation, assembled."""

from __future__ import annotations

import typer

from stepscope.cli import admin, captures, check, jobs, nodes, run, serve, simulate

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="stepscope: training performance observability"
)
app.command()(serve.serve)
app.add_typer(admin.db_app, name="db")
app.add_typer(admin.token_app, name="token")
app.command()(simulate.simulate)


@app.command(
    "run",
    help=f"{run.HELP} Usage: stepscope run [--job-id ID] -- CMD…",
    add_help_option=False,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def run_command(ctx: typer.Context) -> None:
    raise typer.Exit(run.main(ctx.args))


app.command()(jobs.analyze)
app.command()(serve.demo)
app.command()(jobs.jobs)
app.command()(jobs.show)
app.command()(jobs.findings)
app.command()(jobs.goodput)
app.command()(jobs.export)
app.command()(nodes.nodes)
app.command()(captures.capture)
app.command()(captures.captures)
app.command()(check.check)
app.command()(check.report)
