"""Deep captures (#21): `capture` asks a server for one, `captures` lists a job's and
downloads a trace."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from stepscope.cli.jobs import JobIdArgument, reading
from stepscope.cli.options import (
    DbOption,
    OutputOption,
    TokenOption,
    UrlOption,
    checked_output,
    fail,
    stderr,
)
from stepscope.text.fit import elide_middle

_NAME = 42
"""Width of an operator's name in the comparison (the line is 80 columns)."""

if TYPE_CHECKING:
    from stepscope.api.capture_read import CaptureRequestRead


def capture(
    job_id: JobIdArgument,
    rank: Annotated[int, typer.Option("--rank", help="The rank to capture", min=0)],
    steps: Annotated[
        int | None, typer.Option("--steps", help="Steps to record (default: the server's)", min=1)
    ] = None,
    reference: Annotated[
        int | None,
        typer.Option("--reference", help="Reference rank (default: the lowest other)", min=0),
    ] = None,
    output: OutputOption = "text",
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Ask a running job's RANK and a reference rank to record torch.profiler for a few steps
    (told in the answer to their next batch; the token needs the ingest or admin scope)."""
    from stepscope.client import RemoteStore, StoreError

    checked_output(output)
    url = url or os.environ.get("STEPSCOPE_URL")
    if not url:
        raise fail("a capture is asked of the server the job sends to: give --url or STEPSCOPE_URL")
    store = RemoteStore(url, token)
    try:
        request = store.request_capture(
            job_id, rank=rank, reference_rank=reference, num_steps=steps
        )
    except StoreError as exc:
        raise fail(str(exc), code=1) from None
    finally:
        store.close()
    if output == "json":
        typer.echo(request.model_dump_json(indent=2))
        return
    ranks = ", ".join(f"rank {c.rank} ({c.role})" for c in request.captures)
    typer.echo(f"capture {request.id} of job {job_id}: {ranks}, {request.num_steps} steps")
    stderr.print("list it with `stepscope captures JOB` once the ranks have uploaded")


def captures(
    job_id: JobIdArgument,
    download: Annotated[
        int | None, typer.Option("--download", help="Write this capture's trace (a capture id)")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="File for --download (default: its own name)"),
    ] = None,
    output: OutputOption = "text",
    url: UrlOption = None,
    token: TokenOption = None,
    db: DbOption = None,
) -> None:
    """A job's deep captures: each rank's status and top operators, the two side by side;
    with --download ID, write that trace (gzipped Chrome/Perfetto JSON)."""
    checked_output(output)
    if download is not None:
        trace_gz = reading(db, url, token, lambda store: store.capture_trace(download))
        path = out or Path(f"{job_id}-capture{download}.pt.trace.json.gz")
        path.write_bytes(trace_gz)
        stderr.print(f"wrote {len(trace_gz):,} bytes to {path} (open it in ui.perfetto.dev)")
        return
    found = reading(db, url, token, lambda store: store.captures(job_id))
    if output == "json":
        typer.echo(json.dumps([r.model_dump(mode="json") for r in found], indent=2))
        return
    if not found:
        typer.echo(f"no captures of job {job_id}")
    for request in found:
        _print_request(request)


def _print_request(request: CaptureRequestRead) -> None:
    typer.echo(
        f"capture {request.id} ({request.reason}, by {request.requested_by}), "
        f"{request.num_steps} steps:"
    )
    for c in request.captures:
        steps = f" steps {c.first_step}-{c.last_step}" if c.first_step is not None else ""
        size = f", {c.trace_bytes:,} bytes" if c.trace_bytes else ""
        error = f": {c.error}" if c.error else ""
        typer.echo(f"  #{c.id} rank {c.rank} {c.role}: {c.status}{steps}{size}{error}")
    if request.comparison:
        # 80 columns: an operator's name elided in its middle (its namespace and its end)
        typer.echo(f"  {'operator':<{_NAME}} {'culprit s':>10} {'reference s':>12} {'diff s':>10}")
        for d in request.comparison[:10]:
            typer.echo(
                f"  {elide_middle(d.name, _NAME):<{_NAME}} {d.culprit_s:>10.4f} "
                f"{d.reference_s:>12.4f} {d.difference_s:>+10.4f}"
            )
