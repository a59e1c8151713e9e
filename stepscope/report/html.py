"""A job report as one self-contained HTML file: plotly.js inlined once, no network at open.

Every string that comes from a user or a job (names, ids, attributes, findings) is escaped;
figure data is embedded as JSON with `<`, `>` and `&` escaped, so no value can close a tag.
"""

from __future__ import annotations

import json
import math
import time
from html import escape
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from stepscope import figures
from stepscope.analysis.regression.gate import CheckResult
from stepscope.check import outputs
from stepscope.report.collect import ReportData
from stepscope.text import labels
from stepscope.text.findings import cause_text
from stepscope.text.numbers import UNKNOWN, integer, rate, seconds, share, signed_share, value, when

MAX_RANK_ROWS = 32
"""Ranks listed in the per-rank table (slowest first); the figure shows all."""

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1100px;
       padding: 1.5em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 2em; }
.meta { color: #666; } .cards { display: flex; flex-wrap: wrap; gap: 0.8em; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 0.5em 0.9em; min-width: 9em; }
.card b { display: block; font-size: 1.25em; }
table { border-collapse: collapse; margin: 0.6em 0; }
th, td { border-bottom: 1px solid #e5e5e5; padding: 0.25em 0.7em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.pass { color: #2a7d2a; } .regression { color: #c0392b; font-weight: bold; }
.inconclusive { color: #b7791f; } .critical { color: #c0392b; } .warning { color: #b7791f; }
"""


def render(data: ReportData, *, generated_at: float | None = None) -> str:
    """The report as a complete HTML document."""
    s = data.summary
    title = s.name or s.job_id
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>stepscope report: {escape(title)}</title>",
        f"<style>{_STYLE}</style>",
        f"<script>{get_plotlyjs()}</script>",
        "</head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<p class="meta">{_meta(data, generated_at)}</p>',
        _summary(data),
    ]
    if data.verdict is not None:
        parts.append(_verdict(data.verdict, s.benchmark_key))
    parts += _series(data)
    parts.append(_ranks(data))
    parts.append(_findings(data))
    parts.append("</body></html>")
    return "\n".join(parts)


def _figure(fig: go.Figure, element_id: str) -> str:
    """A div and the script that draws `fig` into it, the data safe inside <script>."""
    doc = pio.to_json(fig, validate=False, pretty=False)
    doc = doc.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    config = json.dumps({"responsive": True, "displaylogo": False})
    return (
        f'<div id="{element_id}" class="figure"></div>'
        f"<script>(function(){{var f={doc};"
        f'Plotly.newPlot("{element_id}",f.data,f.layout,{config});}})();</script>'
    )


def _meta(data: ReportData, generated_at: float | None) -> str:
    s = data.summary
    items = [
        f"job <code>{escape(s.job_id)}</code>",
        f"status {escape(s.status)}",
        f"benchmark <code>{escape(s.benchmark_key or UNKNOWN)}</code>",
        f"{integer(s.world_size or s.num_ranks_seen)} ranks on {integer(s.num_nodes)} node(s)",
        escape(s.device_name or "unknown device"),
        f"started {when(s.started_at)}",
        f"ended {when(s.ended_at)}",
        f"report generated {when(generated_at or time.time())}",
    ]
    return " · ".join(items)


def _card(label: str, value: str) -> str:
    return f'<div class="card">{escape(label)}<b>{escape(value)}</b></div>'


def _summary(data: ReportData) -> str:
    s = data.summary
    cards = [
        _card("steps rolled up", str(s.num_steps or 0)),
        _card("step time p50", seconds(s.step_p50_s)),
        _card("step time p90", seconds(s.step_p90_s)),
        _card("tokens/s", rate(s.tokens_per_s)),
        _card("MFU", share(s.mfu)),
        _card(
            "data / compute / comm wait",
            f"{share(s.data_share)} / {share(s.compute_share)} / {share(s.comm_wait_share)}",
        ),
        _card(
            "findings (critical / warning / info)",
            f"{s.num_critical or 0} / {s.num_warning or 0} / {s.num_info or 0}",
        ),
    ]
    attributes = "".join(
        f"<tr><th>{escape(str(k))}</th><td>{escape(v if isinstance(v, str) else json.dumps(v))}"
        "</td></tr>"
        for k, v in sorted((s.attributes or {}).items())
    )
    extra = f"<table>{attributes}</table>" if attributes else ""
    return f'<h2>Summary</h2><div class="cards">{"".join(cards)}</div>{extra}'


def _verdict(result: CheckResult, benchmark_key: str | None) -> str:
    context = outputs.Context(
        benchmark_key=benchmark_key, source="report", fail_on="regression", exit_code=-1
    )
    rows = "".join(
        f"<tr><td><code>{escape(v.metric)}</code></td>"
        f'<td class="num">{escape(value(v.metric, v.baseline, precise=True))}</td>'
        f'<td class="num">{escape(value(v.metric, v.candidate, precise=True))}</td>'
        f'<td class="num">{signed_share(v.effect)}</td>'
        f'<td class="{v.outcome}">{escape(outputs.verdict_label(v))}</td>'
        f"<td>{escape(v.reason)}</td></tr>"
        for v in result.metrics
    )
    why = "".join(f"<li>{escape(line)}</li>" for line in outputs.explanation(result))
    html = [
        "<h2>Check verdict</h2>",
        f'<p class="{result.outcome}">{escape(outputs.headline(result, context))}</p>',
        "<table><tr><th>metric</th><th>baseline</th><th>candidate</th><th>change</th>"
        f"<th>verdict</th><th>why</th></tr>{rows}</table>",
        f"<ul>{why}</ul>" if why else "",
    ]
    step = result.verdict("step_s")
    if step is not None and result.baselines:
        html.append(_figure(_levels_figure(result, step.limit), "fig-verdict"))
    return "\n".join(html)


def _levels_figure(result: CheckResult, limit: float | None) -> go.Figure:
    by_id = {lv.job_id: lv for lv in result.levels}

    def level(job_id: str) -> float:
        lv = by_id[job_id].levels.get("step_s")
        return lv.value if lv else math.nan

    return figures.baseline_levels(
        "step_s",
        result.baselines,
        [level(j) for j in result.baselines],
        candidate_ids=result.candidates,
        candidate_values=[level(j) for j in result.candidates],
        limit=limit,
    )


def _series(data: ReportData) -> list[str]:
    band, tokens, mfu = data.band, data.tokens_per_s, data.mfu
    if band.step.size == 0:
        return ["<h2>Step time</h2><p>No steps rolled up yet.</p>"]
    html = ["<h2>Step time</h2>", _figure(figures.band_figure(band, data.findings), "fig-band")]
    if tokens.step.size:
        fig = figures.rates_figure(tokens, mfu, data.findings)
        html += ["<h2>Throughput and MFU</h2>", _figure(fig, "fig-throughput")]
    return html


def _ranks(data: ReportData) -> str:
    r = data.ranks
    if r.rank.size == 0:
        return "<h2>Ranks</h2><p>No ranks reported.</p>"
    fig = figures.breakdown_figure(r, top=r.rank.size)
    rows = "".join(
        f"<tr><td>{int(r.rank[i])}</td><td>{escape(r.node[i] or UNKNOWN)}</td>"
        + "".join(
            f'<td class="num">{seconds(float(r.median[m][i]))}</td>'
            for m in ("step_s", "data_s", "compute_s", "comm_wait_s")
        )
        + f'<td class="num">{signed_share(float(r.compute_excess[i]))}</td>'
        f'<td class="num">{share(float(r.slowest_share[i]))}</td></tr>'
        for i in range(min(r.rank.size, MAX_RANK_ROWS))
    )
    header = "".join(
        f"<th>{h}</th>"
        for h in (
            "rank",
            "node",
            *(labels.component(m) for m in ("step_s", "data_s", "compute_s", "comm_wait_s")),
            "compute excess",
            "slowest in",
        )
    )
    more = (
        f"<p class=meta>{r.rank.size - MAX_RANK_ROWS} more ranks in the figure.</p>"
        if r.rank.size > MAX_RANK_ROWS
        else ""
    )
    return (
        "<h2>Ranks</h2>"
        + _figure(fig, "fig-ranks")
        + "<p class=meta>Slowest first (own data + compute); median seconds per step.</p>"
        + f"<table><tr>{header}</tr>{rows}</table>"
        + more
    )


def _findings(data: ReportData) -> str:
    if not data.findings:
        return "<h2>Findings</h2><p>No findings.</p>"
    rows = []
    for f in data.findings:
        steps = (
            ""
            if f.first_step is None
            else f"{f.first_step}–{f.last_step if f.last_step is not None else ''}"
        )
        cells: list[Any] = [
            labels.kind(f.kind, long=True),
            f.severity,
            ",".join(map(str, f.ranks)),
            f.node or "",
            steps,
            cause_text(f) or "",
            f.metric or "",
            signed_share(f.effect) if f.effect is not None else "",
        ]
        row = "".join(f"<td>{escape(str(c))}</td>" for c in cells)
        rows.append(f'<tr class="{escape(f.severity)}">{row}</tr>')
    header = "".join(
        f"<th>{h}</th>"
        for h in ("kind", "severity", "ranks", "node", "steps", "cause", "metric", "effect")
    )
    return f"<h2>Findings</h2><table><tr>{header}</tr>{''.join(rows)}</table>"
