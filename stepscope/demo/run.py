"""`stepscope demo`: serve on the embedded database, run the real job with its trouble, say
what stepscope found in it, load a large synthetic job and a fleet, and serve on."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import sqlalchemy as sa
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from stepscope.demo import extras
from stepscope.demo.job import Progress as JobProgress
from stepscope.demo.job import TrainPlan, run_training, torchrun_command
from stepscope.demo.server import DemoServer, start_server
from stepscope.pipeline.job_pass import analyze_stored_job
from stepscope.query.fleet import NodeFilters, list_nodes
from stepscope.query.goodput import job_goodput
from stepscope.schema import Finding
from stepscope.store import jobs
from stepscope.store.findings import load_findings
from stepscope.synthetic.fleet import slow_node_names
from stepscope.text import labels
from stepscope.text.finding_groups import folded_lines, grouped
from stepscope.text.findings import finding_line, subject
from stepscope.text.goodput import top_badput
from stepscope.text.numbers import seconds, share, signed_share

FINISH_WAIT_S = 30.0
"""How long the job's final status may take to arrive after torchrun exits."""
_WIDTH = 120
"""Finding lines are this wide at most (the console folds them where it is narrower)."""


class DemoError(RuntimeError):
    """The demo could not run; the message says why and what to do."""


def run_demo(
    *, database_url: str, port: int, once: bool, console: Console, plan: TrainPlan | None = None
) -> None:
    """The whole demo; returns after it (`once`) or when the server stops (Ctrl-C)."""
    plan = plan or TrainPlan()
    started = time.perf_counter()
    with console.status("starting the server"):
        server = start_server(database_url=database_url, port=port)
    console.print(f"stepscope serving on {server.url} (database {database_url})")
    try:
        job_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
        _run_real_job(server, plan, job_id, console)
        _load_extras(server, job_id, console)
        console.print(f"\n[bold]Dashboard:[/] {server.url}/jobs/{job_id}")
        console.print(
            f"  all jobs {server.url}/   fleet {server.url}/fleet   API {server.url}/docs"
        )
        console.print(f"demo ready in {time.perf_counter() - started:.0f} s")
        if once:
            return
        console.print("serving; Ctrl-C to stop")
        try:
            server.wait()
        except KeyboardInterrupt:
            pass
    finally:
        server.stop()


def _run_real_job(server: DemoServer, plan: TrainPlan, job_id: str, console: Console) -> None:
    engine: sa.Engine = server.app.state.engine
    console.print(
        f"\n[bold]Training[/] job {job_id}: a small transformer, FSDP2 over gloo on CPU, "
        f"{plan.num_ranks} ranks under torchrun, {plan.num_steps} steps. Injected trouble:"
    )
    for line in plan.story():
        console.print(f"  - {line}")
    work = Path(tempfile.mkdtemp(prefix="stepscope-demo-"))
    (work / "ckpt").mkdir()
    log_path = work / "torchrun.log"
    command = torchrun_command(plan, url=server.url, job_id=job_id, ckpt_dir=work / "ckpt")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("starting 4 ranks", total=plan.num_steps)

        so_far = _SoFar(engine, job_id)

        def on_progress(said: JobProgress) -> None:
            if said.kind == "step" and said.step is not None:
                bar.update(
                    task, completed=said.step + 1, description=f"step {said.step}{so_far.text()}"
                )
            elif said.kind == "checkpoint":
                bar.console.print(f"  checkpoint saved before step {said.step}")
            elif said.kind == "crash":
                bar.console.print(
                    f"  [red]rank {said.rank} crashed in step {said.step}[/]; "
                    "torchrun restarts the job"
                )
                bar.update(task, description="restarting")
            elif said.kind == "restart":
                bar.console.print(f"  restarted: resumed from the checkpoint of step {said.step}")

        returncode = run_training(command, log_path, on_progress)
    if returncode != 0:
        raise DemoError(f"the training job failed (exit code {returncode}); see {log_path}")
    with console.status("waiting for the job's last records, then the final analysis"):
        status = _wait_for_end(engine, job_id)
        found = analyze_stored_job(engine, job_id)
    if status != "finished":
        console.print(f"[yellow]the job's final status did not arrive ({status}); see {log_path}")
    _print_found(engine, job_id, found, console)


class _SoFar:
    """What the background analysis has found in the live job so far, in a few words, read at
    most every SO_FAR_EVERY_S: provisional (the final analysis may withdraw or change it), so
    it is shown beside the progress bar only, never printed as a result."""

    SO_FAR_EVERY_S = 2.0

    def __init__(self, engine: sa.Engine, job_id: str) -> None:
        self._engine = engine
        self._job_id = job_id
        self._read_at = 0.0
        self._text = ""

    def text(self) -> str:
        now = time.monotonic()
        if now - self._read_at >= self.SO_FAR_EVERY_S:
            self._read_at = now
            found = [
                f"{subject(f)} {f.cause or labels.kind(f.kind)}"
                for f in load_findings(self._engine, self._job_id)
                if f.severity in ("warning", "critical")
            ]
            self._text = f"; so far (provisional): {', '.join(found)}" if found else ""
        return self._text


def _wait_for_end(engine: sa.Engine, job_id: str) -> str | None:
    """The job's status once it ended (its rank 0 sent it at close), or as it is after a wait."""
    deadline = time.monotonic() + FINISH_WAIT_S
    while True:
        row = jobs.load_job(engine, job_id)
        status = row["status"] if row else None
        if status in ("finished", "failed") or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def _print_found(engine: sa.Engine, job_id: str, found: list[Finding], console: Console) -> None:
    """The findings of the final analysis, the restart and the goodput."""
    console.print(f"\n[bold]What stepscope found[/] in {job_id} (final analysis):")
    shown = [f for f in found if f.severity in ("warning", "critical")] or found
    _print_lines(shown, console)
    result = job_goodput(engine, job_id, with_windows=False)
    gp = result.result
    for before, after in zip(gp.incarnations, gp.incarnations[1:], strict=False):
        failure = before.failure or {}
        lost = before.lost_steps
        lost_text = (
            f"steps {lost[0]}-{lost[1]} lost ({lost[1] - lost[0] + 1} steps)"
            if lost
            else "no step lost"
        )
        console.print(
            f"  restart   rank {failure.get('rank', '?')} raised in step "
            f"{failure.get('step', before.interrupted_step)}: {failure.get('message', '?')}",
            highlight=False,
        )
        # Per rank: the restart's downtime, then the new processes' start-up to their first step.
        back_s = before.categories.get("restart_downtime", 0.0) + after.categories.get(
            "startup", 0.0
        )
        console.print(
            f"            resumed at step {before.resumed_at}: {lost_text}; stepping again "
            f"{seconds(back_s / max(after.num_ranks, 1))} after the failed run ended",
            highlight=False,
        )
    badput = top_badput(gp.categories, gp.total_s, result.responsible)
    console.print(
        f"  goodput   {share(gp.share('productive'))} of {gp.total_s:.0f} GPU-s; "
        f"largest badput: {', '.join(badput)}",
        highlight=False,
    )


def _print_lines(found: list[Finding], console: Console) -> None:
    """The findings, the most pressing first, with the changes each explains folded under it."""
    for group in grouped(found, lambda f: f):
        lines = [finding_line(group.root, width=_WIDTH), *folded_lines(group.folded, _WIDTH)]
        for line in lines:
            console.print(f"  {line}", highlight=False)


def _load_extras(server: DemoServer, job_id: str, console: Console) -> None:
    engine: sa.Engine = server.app.state.engine
    large_id = f"{job_id}-synthetic-1024"
    with console.status(
        f"loading a synthetic {extras.LARGE_RANKS:,}-rank job ({extras.LARGE_STEPS} steps) "
        "and analysing it"
    ):
        found = extras.load_large_job(engine, large_id)
    console.print(
        f"\nloaded {large_id}: {extras.LARGE_RANKS:,} ranks x {extras.LARGE_STEPS} steps "
        f"(synthetic), {len(found)} finding(s):"
    )
    _print_lines(found, console)
    with console.status("loading a synthetic fleet"):
        num_jobs = extras.load_fleet(engine)
    fleet = f"{extras.FLEET.num_jobs} jobs on {extras.FLEET.num_nodes} nodes"
    slowed = slow_node_names(extras.FLEET)
    made_slow = ", ".join(f"{node} {signed_share(effect, 0)}" for node, effect in slowed.items())
    if num_jobs:
        console.print(
            f"loaded a synthetic fleet: {fleet}, {len(slowed)} of them made slow ({made_slow})",
            highlight=False,
        )
    else:
        console.print(f"the synthetic fleet ({fleet}) is in this database already")
    _print_fleet_health(engine, console)


def _print_fleet_health(engine: sa.Engine, console: Console) -> None:
    """The suspects as the Fleet page and `stepscope nodes --suspect` show them (one query)."""
    page = list_nodes(engine, NodeFilters(suspect=True))
    named = [f"{n['node']} {signed_share(n['effect'], 0)}" for n in page.nodes]
    console.print(
        f"fleet health (/fleet, stepscope nodes --suspect): {page.num_suspects} suspect "
        f"node(s) of {page.num_nodes} in {page.num_jobs} jobs"
        + (f": {', '.join(named)}" if named else ""),
        highlight=False,
    )
