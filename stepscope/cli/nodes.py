"""`stepscope nodes`: fleet health, as a table, JSON, or scheduler lines to act on it."""

from __future__ import annotations

from typing import Annotated

import typer

from stepscope.cli.options import DbOption, TokenOption, UrlOption, fail, stderr

FORMATS = ("table", "json", "slurm", "kubectl")


def nodes(
    suspect: Annotated[bool, typer.Option("--suspect", help="Only the suspect nodes")] = False,
    output: Annotated[
        str,
        typer.Option(
            "--format",
            help="table, json, slurm (an --exclude list and scontrol drain lines) or kubectl "
            "(cordon and taint lines); the lines are printed, never run",
        ),
    ] = "table",
    name: Annotated[str | None, typer.Option("--name", help="Substring of the node")] = None,
    sort: Annotated[
        str, typer.Option("--sort", help="effect, confidence, num_jobs, node, since; '-' descends")
    ] = "-effect",
    limit: Annotated[int, typer.Option("--limit", min=1)] = 100,
    url: UrlOption = None,
    token: TokenOption = None,
    db: DbOption = None,
) -> None:
    """Nodes by their own effect on step time over every stored job (docs/fleet.md)."""
    from stepscope.cli.jobs import reading
    from stepscope.client import NodesRequest

    if output not in FORMATS:
        raise fail(f"--format must be one of {', '.join(FORMATS)}; got {output!r}")
    if output in ("slurm", "kubectl") and not suspect:
        raise fail(f"--format {output} prints actions: add --suspect (act on suspects only)")
    request = NodesRequest(suspect=suspect, name=name, sort=sort, limit=limit)
    page = reading(db, url, token, lambda r: r.nodes(request))
    if output == "json":
        typer.echo(page.model_dump_json(indent=2))
        return
    rows = [n.model_dump() for n in page.nodes]
    if output == "table":
        from stepscope.cli.output import print_nodes

        print_nodes(page)
        return
    from stepscope.text import fleet

    pattern = fleet.SLURM_HOST if output == "slurm" else fleet.K8S_NODE
    for host in fleet.unusable_hosts(rows, pattern):
        stderr.print(f"left out {host!r}: not a name {output} takes as it is")
    lines = fleet.slurm_lines(rows) if output == "slurm" else fleet.kubectl_lines(rows)
    typer.echo("\n".join(lines))
