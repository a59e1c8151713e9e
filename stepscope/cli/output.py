"""What the CLI's read commands print: jobs tables, job summaries, finding lines."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from stepscope.api.fleet_read import NodesPage
from stepscope.api.goodput_read import FleetGoodputRead, GoodputRead
from stepscope.api.schemas import FindingRead, JobsPage, JobSummaryRead
from stepscope.schema import FINDINGS, Finding
from stepscope.text.findings import finding_line, mesh_sentence
from stepscope.text.goodput import responsible_text, top_badput
from stepscope.text.labels import goodput_category
from stepscope.text.numbers import integer, known, rate, seconds, share, signed_share, when


def print_finding_lines(findings: Iterable[Finding | FindingRead]) -> None:
    """One line per finding (and, indented, where in the mesh it is: the group a
    straggler's peers waited in, a slow collective's group), or 'no findings'."""
    lines = []
    for f in findings:
        finding = _as_finding(f) if isinstance(f, FindingRead) else f
        lines.append(f.text if isinstance(f, FindingRead) else finding_line(f))
        where = mesh_sentence(finding)
        if where:
            lines.append(
                textwrap.fill(where, width=80, initial_indent="  ", subsequent_indent="  ")
            )
    typer.echo("\n".join(lines) if lines else "no findings")


def _as_finding(f: FindingRead) -> Finding:
    return Finding(**{name: getattr(f, name) for name in FINDINGS.names})


def print_jobs(page: JobsPage) -> None:
    """The jobs as a table, and how to get the next page."""
    if not page.jobs:
        typer.echo("no jobs")
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    table.add_column("job", overflow="fold")
    for header in ("status", "ranks", "step p50", "tokens/s", "MFU", "c/w/i", "started UTC"):
        table.add_column(header, no_wrap=True)
    for j in page.jobs:
        counts = (j.num_critical, j.num_warning, j.num_info)
        table.add_row(
            j.job_id,
            j.status,
            integer(j.world_size),
            seconds(j.step_p50_s),
            rate(j.tokens_per_s),
            share(j.mfu),
            "/".join(integer(c) for c in counts) if j.num_info is not None else "",
            when(j.started_at, short=True),
        )
    Console().print(table)
    if page.next_cursor:
        typer.echo(f"more: --cursor {page.next_cursor}")


def print_nodes(page: NodesPage) -> None:
    """The nodes as a table (suspects marked), and the fleet's figures."""
    typer.echo(
        f"{integer(page.num_nodes)} node(s) over {integer(page.num_jobs)} job(s), "
        f"{integer(page.num_suspects)} suspect(s); job-to-job noise of a node "
        f"{share(page.job_noise)}"
    )
    if not page.nodes:
        typer.echo("no nodes")
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    table.add_column("node", overflow="fold")
    for header in ("effect", "confidence", "jobs", "since UTC", "suspect"):
        table.add_column(header, no_wrap=True)
    for n in page.nodes:
        table.add_row(
            n.node,
            signed_share(n.effect),
            share(n.confidence, 0),
            f"{n.num_jobs}/{n.num_jobs_total}",
            when(n.since, short=True) if n.since else "",
            "SUSPECT" if n.suspect else "",
        )
    Console().print(table)


def print_summary(s: JobSummaryRead, findings: list[FindingRead]) -> None:
    """A job's summary in a few lines, then its findings, one a line."""
    named = f" ({s.name})" if s.name and s.name != s.job_id else ""
    lines = [f"job {s.job_id}{named}: {s.status}"]
    if s.benchmark_key:
        lines.append(f"benchmark key  {s.benchmark_key}")
    size = f"{integer(s.world_size or s.num_ranks_seen)} ranks on {integer(s.num_nodes)} node(s)"
    device = f", {s.device_name}" if s.device_name else ""
    peak = f", peak {s.peak_flops / 1e12:,.0f} TFLOP/s" if s.peak_flops else ", peak unknown"
    lines.append(f"size           {size}{device}{peak}")
    if s.first_step is not None:
        lines.append(
            f"steps          {s.first_step}-{s.last_step} ({integer(s.num_steps)} rolled up)"
        )
    lines.append(f"started        {when(s.started_at)}, last seen {when(s.last_seen)}")
    if s.analysed_at is None:
        lines.append("not analysed yet: run `stepscope analyze JOB` or wait for the server")
    else:
        lines.append(
            f"step time      p50 {seconds(s.step_p50_s)}, p90 {seconds(s.step_p90_s)}; "
            f"{rate(s.tokens_per_s)} tokens/s, {rate(s.samples_per_s)} samples/s"
        )
        mfu = share(s.mfu) if known(s.mfu) else "unknown"
        lines.append(
            f"MFU            {mfu}; of the step: compute "
            f"{share(s.compute_share)}, comm wait {share(s.comm_wait_share)}, "
            f"data {share(s.data_share)}"
        )
        lines.append(
            f"findings       {integer(s.num_critical)} critical, {integer(s.num_warning)} warning, "
            f"{integer(s.num_info)} info"
        )
    typer.echo("\n".join(lines))
    if findings:
        typer.echo("")
        print_finding_lines(findings)


def print_findings(findings: list[Finding], output: str) -> None:
    """Findings of an analysis one readable line each, or as JSON (--format json)."""
    import orjson

    if output == "json":
        typer.echo(
            orjson.dumps([f.to_dict() for f in findings], option=orjson.OPT_INDENT_2).decode()
        )
        return
    print_finding_lines(findings)


def goodput_headline(g: GoodputRead) -> list[str]:
    """The goodput in two lines: the share and GPU-hours lost, and the top three causes."""
    if g.total_gpu_s <= 0:
        return ["goodput        unknown (no steps or lifecycle events yet)"]
    lost_h = (g.total_gpu_s - g.categories["productive"].gpu_s) / 3600
    restarts = max(0, len(g.incarnations) - 1)
    lines = [
        f"goodput        {share(g.goodput)} of {g.total_gpu_s / 3600:,.2f} GPU-h; "
        f"{lost_h:,.2f} GPU-h lost; {restarts} restart(s)"
    ]
    gpu_s = {c: v.gpu_s for c, v in g.categories.items()}
    badput = top_badput(gpu_s, g.total_gpu_s, g.responsible)
    if badput:
        causes = ", ".join(badput)
        line = f"top badput     {causes}"
        lines.append(line if len(line) <= 80 else line[:79] + "…")
    return lines


def print_goodput(g: GoodputRead) -> None:
    """One line per category (GPU-hours and share), then the incarnations; 80 columns."""
    typer.echo("\n".join(goodput_headline(g)))
    for category, value in g.categories.items():
        if abs(value.share) < 5e-4 and category != "productive":
            continue  # nothing there (unaccounted can be a rounding residue)
        who = responsible_text(g.responsible.get(category, []))
        typer.echo(
            f"  {goodput_category(category):<16} {value.gpu_s / 3600:>10,.3f} GPU-h "
            f"{share(value.share):>7}{who}"[:80]
        )
    layers = ", ".join(
        f"{name} {share(value) if value is not None else 'unknown'}"
        for name, value in g.layers.items()
    )
    typer.echo(textwrap.fill(f"layers: {layers}", width=80))
    for inc in g.incarnations:
        steps = (
            f"steps {inc.first_step}-{inc.last_step}" if inc.first_step is not None else "no step"
        )
        lost = f", lost {inc.lost_steps[0]}-{inc.lost_steps[1]}" if inc.lost_steps else ""
        failure = ""
        if inc.failure is not None:
            failure = f"; rank {inc.failure['rank']}: {inc.failure['message']}"
        line = f"incarnation {inc.index}: {steps}{lost}{failure}"
        typer.echo(line if len(line) <= 80 else line[:79] + "…")


def print_fleet_goodput(g: FleetGoodputRead) -> None:
    """The fleet's goodput, one line per category, then one per job (most lost first)."""
    typer.echo(
        f"goodput {share(g.goodput)} of {g.gpu_hours:,.2f} GPU-h over {g.num_jobs} job(s), "
        f"{when(g.since, short=True)} to {when(g.until, short=True)} UTC"
    )
    for category, value in g.categories.items():
        if abs(value.share) < 5e-4 and category != "productive":
            continue
        typer.echo(
            f"  {goodput_category(category):<16} {value.gpu_hours:>10,.3f} GPU-h "
            f"{share(value.share):>7}"
        )
    for job in g.jobs:
        lost = top_badput(job.categories, job.gpu_hours, {}, num=1)
        line = f"{job.job_id}: {share(job.goodput)} of {job.gpu_hours:,.3f} GPU-h" + (
            f"; most lost: {lost[0]}" if lost else ""
        )
        typer.echo(line if len(line) <= 80 else line[:79] + "…")
