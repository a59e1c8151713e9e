"""What the CLI's read commands print: jobs tables, job summaries, finding lines."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from stepscope.api.fleet_read import NodesPage
from stepscope.api.goodput_read import FleetGoodputRead, GoodputRead
from stepscope.api.schemas import FindingRead, JobsPage, JobSummaryRead
from stepscope.schema import FINDINGS, Finding
from stepscope.text.finding_groups import folded_lines, grouped
from stepscope.text.findings import WIDTH, finding_line, mesh_sentence
from stepscope.text.fit import (
    MIN_ID_WIDTH,
    Column,
    clip,
    elide_middle,
    first_fitting,
    fit_columns,
    pack,
)
from stepscope.text.goodput import responsible_text, top_badput
from stepscope.text.labels import goodput_category
from stepscope.text.numbers import integer, known, rate, seconds, share, signed_share, when


def print_finding_lines(findings: Iterable[Finding | FindingRead], width: int = WIDTH) -> None:
    """One line per finding, the most pressing first (text.finding_groups); under it,
    indented, the job-level changes it explains on one line, and where in the mesh it is
    (the group a straggler's peers waited in, a slow collective's group); or 'no findings'."""
    lines = []
    for group in grouped(list(findings), _as_finding):
        finding = _as_finding(group.root)
        root = group.root
        lines.append(root.text if isinstance(root, FindingRead) else finding_line(root, width))
        lines += folded_lines([_as_finding(f) for f in group.folded], width)
        where = mesh_sentence(finding)
        if where:
            lines += textwrap.wrap(
                where,
                width=width,
                initial_indent="  ",
                subsequent_indent="  ",
                break_long_words=False,
                break_on_hyphens=False,
            )
    typer.echo("\n".join(lines) if lines else "no findings")


def _as_finding(f: Finding | FindingRead) -> Finding:
    if isinstance(f, Finding):
        return f
    return Finding(**{name: getattr(f, name) for name in FINDINGS.names})


def _findings_cell(critical: int | None, warning: int | None, info: int | None) -> str:
    """A job's findings by severity, spelled out: "3 crit 1 warn", "none"; "" when the job
    is not analysed yet."""
    if critical is None or warning is None or info is None:
        return ""
    counts = ((critical, "crit"), (warning, "warn"), (info, "info"))
    return " ".join(f"{n} {name}" for n, name in counts if n) or "none"


def print_table(columns: Sequence[Column], width: int) -> None:
    """Columns as a table of at most `width` characters: lower-value columns dropped, ids
    elided in the middle, no cell wrapped."""
    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        collapse_padding=True,
    )
    fitted = fit_columns(columns, width, gap=2)
    for column in fitted:
        table.add_column(column.header, no_wrap=True, overflow="ellipsis")
    for row in zip(*(c.cells for c in fitted), strict=True):
        table.add_row(*row)
    console = Console(width=width, highlight=False)
    with console.capture() as captured:
        console.print(table)
    typer.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def print_jobs(page: JobsPage) -> None:
    """The jobs as a table that fits the terminal, and how to get the next page."""
    if not page.jobs:
        typer.echo("no jobs")
        return
    jobs = page.jobs
    columns = [
        Column("job", [j.job_id for j in jobs], elide=True),
        Column("status", [j.status for j in jobs]),
        Column("ranks", [integer(j.world_size) for j in jobs], drop_order=0),
        Column("step p50", [seconds(j.step_p50_s) for j in jobs], drop_order=2),
        Column("tokens/s", [rate(j.tokens_per_s) for j in jobs], drop_order=1),
        Column("MFU", [share(j.mfu) for j in jobs], drop_order=3),
        Column(
            "findings",
            [_findings_cell(j.num_critical, j.num_warning, j.num_info) for j in jobs],
        ),
        Column("started UTC", [when(j.started_at, short=True) for j in jobs], drop_order=4),
    ]
    print_table(columns, terminal_width())
    if page.next_cursor:
        typer.echo(f"more: --cursor {page.next_cursor}")


def terminal_width() -> int:
    """The terminal's width: COLUMNS when set, 80 when not a terminal."""
    return Console().width


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
    nodes = page.nodes
    columns = [
        Column("node", [n.node for n in nodes], elide=True),
        Column("effect", [signed_share(n.effect) for n in nodes]),
        Column("confidence", [share(n.confidence, 0) for n in nodes], drop_order=1),
        Column("jobs", [f"{n.num_jobs}/{n.num_jobs_total}" for n in nodes], drop_order=0),
        Column(
            "since UTC", [when(n.since, short=True) if n.since else "" for n in nodes], drop_order=2
        ),
        Column("suspect", ["SUSPECT" if n.suspect else "" for n in nodes]),
    ]
    print_table(columns, terminal_width())


def print_summary(s: JobSummaryRead, findings: list[FindingRead]) -> None:
    """A job's summary in a few lines of at most 80 characters, then its findings."""
    lines = [_job_line(s.job_id, s.name, s.status)]
    if s.benchmark_key:
        lines.append(f"{'benchmark key':<{_LABEL}}{elide_middle(s.benchmark_key, WIDTH - _LABEL)}")
    size = f"{integer(s.world_size or s.num_ranks_seen)} ranks on {integer(s.num_nodes)} node(s)"
    peak = f"peak {s.peak_flops / 1e12:,.0f} TFLOP/s" if s.peak_flops else "peak unknown"
    lines += _field("size", *(f"{c}," for c in (size, s.device_name) if c), peak)
    if s.first_step is not None:
        lines += _field(
            "steps", f"{s.first_step}-{s.last_step}", f"({integer(s.num_steps)} rolled up)"
        )
    lines += _field("started", f"{when(s.started_at)},", f"last seen {when(s.last_seen)}")
    if s.analysed_at is None:
        lines.append("not analysed yet: run `stepscope analyze JOB` or wait for the server")
    else:
        lines += _field(
            "step time",
            f"p50 {seconds(s.step_p50_s)},",
            f"p90 {seconds(s.step_p90_s)};",
            f"{rate(s.tokens_per_s)} tokens/s,",
            f"{rate(s.samples_per_s)} samples/s",
        )
        mfu = share(s.mfu) if known(s.mfu) else "unknown"
        lines += _field(
            "MFU",
            f"{mfu}; of the step:",
            f"compute {share(s.compute_share)},",
            f"comm wait {share(s.comm_wait_share)},",
            f"data {share(s.data_share)}",
        )
        lines += _field(
            "findings",
            f"{integer(s.num_critical)} critical,",
            f"{integer(s.num_warning)} warning,",
            f"{integer(s.num_info)} info",
        )
    typer.echo("\n".join(lines))
    if findings:
        typer.echo("")
        print_finding_lines(findings)


_LABEL = 15
"""Width of a summary line's label ("step time      ")."""


def _field(label: str, *chunks: str) -> list[str]:
    """A labelled summary line: its chunks (each with its punctuation) packed whole into
    lines of at most 80 characters, continuation lines under the first value."""
    return pack([f"{label:<{_LABEL}}{chunks[0]}", *chunks[1:]], WIDTH, sep=" ", indent=" " * _LABEL)


def _job_line(job_id: str, name: str | None, status: str) -> str:
    """ "job ID (NAME): STATUS" in 80 characters: the name elided first, then the id, each in
    its middle."""
    tail = f": {status}"
    job_id = elide_middle(job_id, WIDTH - len("job ") - len(tail))
    line = f"job {job_id}{tail}"
    room = WIDTH - len(line) - len(" ()")
    if name and name != job_id and room >= MIN_ID_WIDTH:
        line = f"job {job_id} ({elide_middle(name, room)}){tail}"
    return line


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
        lines.append(f"{'top badput':<{_LABEL}}{first_fitting(badput, WIDTH - _LABEL)}")
    return lines


def print_goodput(g: GoodputRead) -> None:
    """One line per category (GPU-hours and share), then the incarnations; 80 columns."""
    typer.echo("\n".join(goodput_headline(g)))
    for category, value in g.categories.items():
        if abs(value.share) < 5e-4 and category != "productive":
            continue  # nothing there (unaccounted can be a rounding residue)
        who = responsible_text(g.responsible.get(category, []))
        line = (
            f"  {goodput_category(category):<16} {value.gpu_s / 3600:>10,.3f} GPU-h "
            f"{share(value.share):>7}{who}"
        )
        typer.echo(clip(line, WIDTH))
    layers = [
        f"{name} {share(value) if value is not None else 'unknown'}"
        for name, value in g.layers.items()
    ]
    if layers:
        layers[0] = f"layers: {layers[0]}"
    typer.echo("\n".join(pack(layers, WIDTH, indent="  ")))
    for inc in g.incarnations:
        steps = (
            f"steps {inc.first_step}-{inc.last_step}" if inc.first_step is not None else "no step"
        )
        lost = f", lost {inc.lost_steps[0]}-{inc.lost_steps[1]}" if inc.lost_steps else ""
        failure = ""
        if inc.failure is not None:
            failure = f"; rank {inc.failure['rank']}: {inc.failure['message']}"
        line = f"incarnation {inc.index}: {steps}{lost}{failure}"
        typer.echo(clip(line, WIDTH))


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
        typer.echo(clip(line, WIDTH))
