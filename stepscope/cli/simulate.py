"""`stepscope simulate`: stream a synthetic job to a collector through the wire protocol."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from stepscope.cli.options import fail, stderr


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
    nodes: Annotated[
        str | None,
        typer.Option(
            "--nodes",
            help="HOST,HOST,…: place the ranks on these hosts in order, --ranks-per-node at a "
            "time (each rank also gets a GPU UUID); default node-0000, node-0001, …",
        ),
    ] = None,
    ranks_per_node: Annotated[int, typer.Option("--ranks-per-node", min=1)] = 8,
) -> None:
    """Stream a realistic synthetic job to a collector through the wire protocol."""
    import time

    from stepscope.synthetic.generate import JobSpec, generate
    from stepscope.synthetic.stream import stream_job

    hosts = tuple(h.strip() for h in nodes.split(",")) if nodes else ()
    if any(not h for h in hosts):
        raise fail(f"bad --nodes {nodes!r}: expected HOST,HOST,… without empty names")
    try:
        spec = JobSpec(
            job_id=job_id or f"sim-{int(time.time())}",
            num_ranks=ranks,
            num_steps=steps,
            ranks_per_node=ranks_per_node,
            base_step_s=step_time_s,
            stragglers=tuple(_parse_straggler(s) for s in straggler or ()),
            start_ts=time.time(),
            seed=seed,
            hosts=hosts,
        )
    except ValueError as exc:
        raise fail(str(exc)) from None
    stats = stream_job(
        generate(spec), url, token=token, steps_per_batch=steps_per_batch, steps_per_s=steps_per_s
    )
    if stats.failures:
        raise fail(f"{len(stats.failures)} batch(es) failed, first: {stats.failures[0]}", code=1)
    stderr.print(
        f"job {spec.job_id}: {stats.batches} batches, {stats.rows} rows in {stats.elapsed_s:.1f} s"
    )
