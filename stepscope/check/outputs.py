"""The gate's verdict as a terminal table, JSON, JUnit XML, Markdown and GitHub annotations."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

import orjson
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from stepscope.analysis.regression.gate import CheckResult, MetricVerdict
from stepscope.schema import GOODPUT_METRICS
from stepscope.text import numbers
from stepscope.text.fit import MIN_ID_WIDTH, elide_middle

TITLE = "stepscope check"
_LABELS = {"pass": "pass", "regression": "REGRESSION", "inconclusive": "inconclusive"}
_STYLES = {"pass": "green", "regression": "bold red", "inconclusive": "yellow"}
MIN_SHARE = 0.05
"""Components with a smaller share of the change are left out of the explanation."""
_ICONS = {"pass": "✅", "regression": "❌", "inconclusive": "⚠️"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """What was checked, for the reports: the benchmark and where the jobs came from."""

    benchmark_key: str | None
    source: str
    fail_on: str
    exit_code: int


def _value(metric: str, value: float | None) -> str:
    """A metric's value as the gate's tables show it: 4 significant digits, with its unit."""
    return numbers.value(metric, value, precise=True)


def verdict_label(v: MetricVerdict) -> str:
    """REGRESSION / pass / inconclusive, with (weak) and (improved) marks."""
    label = _LABELS[v.outcome]
    if v.improved:
        label = "improved"
    return f"{label} (weak)" if v.weak else label


def _change(v: MetricVerdict) -> str:
    if v.metric in GOODPUT_METRICS:  # shares change in percentage points
        return numbers.UNKNOWN if v.effect is None else f"{100 * v.effect:+.2f} pp"
    return numbers.signed_share(v.effect)


def _limit(v: MetricVerdict) -> str:
    if v.limit is None:
        return numbers.UNKNOWN
    return ("≥ " if v.higher_is_better else "≤ ") + _value(v.metric, v.limit)


def headline(result: CheckResult, context: Context) -> str:
    """One line: the outcome, the candidate(s) and what they were compared with."""
    cands = ", ".join(result.candidates)
    key = f" of {context.benchmark_key}" if context.benchmark_key else ""
    weak = " (weak: one baseline)" if result.weak else ""
    return (
        f"{_LABELS[result.outcome]}{weak}: {cands} against {len(result.baselines)} "
        f"baseline job(s){key}"
    )


def explanation(result: CheckResult) -> list[str]:
    """Sentences on what moved: the components' shares and where on the ranks."""
    lines: list[str] = []
    a = result.attribution
    step = result.verdict("step_s")
    if a is not None and a.components and step is not None and step.outcome == "regression":
        parts = [
            f"{c.metric} +{_value(c.metric, c.change_s)} ({c.share:.0%} of the change)"
            for c in a.components
            if c.change_s > 0 and math.isfinite(c.share) and c.share >= MIN_SHARE
        ]
        if parts:
            lines.append("Step time grew in " + ", ".join(parts) + ".")
    if a is not None and a.ranks is not None and step is not None and step.outcome != "pass":
        r = a.ranks
        if r.scope == "spread":
            lines.append(
                f"Spread over the ranks: the typical rank's own work {r.typical_growth:+.1%}."
            )
        else:
            named = ", ".join(
                f"rank {c.rank}{f' ({c.node})' if c.node else ''} {c.component} {c.growth:+.0%}"
                for c in r.ranks[:8]
            )
            where = f"node {', '.join(r.nodes)}" if r.scope == "node" else "some ranks"
            lines.append(
                f"Concentrated on {where}: {named} (typical rank {r.typical_growth:+.1%})."
            )
    for d in result.dropped:
        lines.append(f"Baseline {d.job_id} dropped: {d.reason}.")
    lines += [f"Note: {n}." for n in result.notes]
    return lines


def terminal(result: CheckResult, context: Context, width: int = 80) -> RenderableType:
    """The verdict as a compact table that fits `width` columns, with the explanation: no
    cell wraps; a metric name too long for its column is elided in its middle, and a weak
    verdict says so in the title alone when every metric is weak."""
    said_weak = result.weak and all(v.weak for v in result.metrics)
    rows = [
        [
            v.metric,
            _value(v.metric, v.baseline),
            _value(v.metric, v.candidate),
            _change(v),
            _limit(v),
            _LABELS[v.outcome] if said_weak and not v.improved else verdict_label(v),
        ]
        for v in result.metrics
    ]
    headers = ("metric", "baseline", "candidate", "change", "limit", "verdict")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    room = width - sum(widths[1:]) - 2 * (len(headers) - 1)
    table = Table(
        box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True, expand=False
    )
    for name in headers:
        justify = "left" if name in ("metric", "verdict") else "right"
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for v, row in zip(result.metrics, rows, strict=True):
        metric = elide_middle(row[0], max(room, MIN_ID_WIDTH))
        table.add_row(metric, *row[1:5], Text(row[5], style=_STYLES[v.outcome]))
    title = Text(f"{TITLE}: ", style="bold")
    title.append(headline(result, context), style=_STYLES[result.outcome])
    why = [Text(line) for line in explanation(result)]
    return Group(title, table, *why)


def to_json(result: CheckResult, context: Context) -> bytes:
    """The verdict and every number behind it as JSON."""
    doc = {
        "tool": TITLE,
        "outcome": result.outcome,
        "exit_code": context.exit_code,
        "benchmark_key": context.benchmark_key,
        "source": context.source,
        "fail_on": context.fail_on,
        "explanation": explanation(result),
        **result.to_dict(),
    }
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)


def _numbers(v: MetricVerdict) -> str:
    """The numbers behind one verdict, one per line."""
    rows: list[tuple[str, Any]] = [
        ("candidate", _value(v.metric, v.candidate)),
        ("baseline (geometric mean)", _value(v.metric, v.baseline)),
        (
            "baseline range",
            f"{_value(v.metric, v.baseline_min)} – {_value(v.metric, v.baseline_max)}",
        ),
        ("change", _change(v)),
        ("limit", _limit(v)),
        ("p-value", numbers.UNKNOWN if v.p_value is None else f"{v.p_value:.3g}"),
        ("alpha (corrected)", f"{v.alpha:.3g}"),
        ("baselines", v.num_baselines),
    ]
    if v.step_share is not None:
        rows.append(("share of the step time", f"{v.step_share:+.2%}"))
    if v.candidate_se is not None:
        rows.append(("candidate standard error", f"±{v.candidate_se:.2%}"))
    return "\n".join([v.reason, *(f"{k}: {value}" for k, value in rows)])


def to_junit(result: CheckResult, context: Context) -> bytes:
    """JUnit XML: a testcase per metric; a regression fails with the numbers, an
    inconclusive metric is skipped (fails with --fail-on any)."""
    suite_name = (
        f"{TITLE}: {', '.join(result.candidates)} vs {context.benchmark_key or 'baselines'}"
    )
    suites = ET.Element("testsuites", name=TITLE)
    failures = skipped = 0
    suite = ET.SubElement(suites, "testsuite", name=suite_name)
    for v in result.metrics:
        case = ET.SubElement(suite, "testcase", classname="stepscope.check", name=v.metric)
        message = f"{v.metric}: {verdict_label(v)}: {v.reason}"
        fails = v.outcome == "regression" or (
            v.outcome == "inconclusive" and context.fail_on == "any"
        )
        if fails and context.fail_on != "never":
            failures += 1
            failure = ET.SubElement(case, "failure", message=message, type=v.outcome)
            failure.text = _numbers(v)
        else:
            if v.outcome == "inconclusive":
                skipped += 1
                ET.SubElement(case, "skipped", message=message)
            ET.SubElement(case, "system-out").text = _numbers(v)
    for element in (suite, suites):
        element.set("tests", str(len(result.metrics)))
        element.set("failures", str(failures))
        element.set("errors", "0")
    suite.set("skipped", str(skipped))
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True) + b"\n"


def _md(text: str) -> str:
    """Text safe in a Markdown table cell."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def to_markdown(result: CheckResult, context: Context) -> str:
    """A GitHub-flavoured Markdown summary: headline, table, explanation, details."""
    lines = [
        f"### {_ICONS[result.outcome]} {TITLE}: {_md(headline(result, context))}",
        "",
        f"alpha {result.config.alpha:g} over the metrics tested, minimum effect "
        f"{result.config.min_effect:.0%}; exit code {context.exit_code}.",
        "",
        "| metric | baseline | candidate | change | limit | verdict |",
        "|---|--:|--:|--:|--:|---|",
    ]
    for v in result.metrics:
        cells = (
            f"`{v.metric}`",
            _value(v.metric, v.baseline),
            _value(v.metric, v.candidate),
            _change(v),
            _limit(v),
            f"**{verdict_label(v)}**" if v.outcome == "regression" else verdict_label(v),
        )
        lines.append("| " + " | ".join(_md(c) if i else c for i, c in enumerate(cells)) + " |")
    lines.append("")
    lines += [f"- {_md(line)}" for line in explanation(result)]
    lines += ["", "<details><summary>Why each verdict</summary>", ""]
    lines += [f"- `{v.metric}`: {_md(v.reason)}" for v in result.metrics]
    used = ", ".join(f"`{_md(b)}`" for b in result.baselines) or "none"
    lines += ["", f"Baselines used: {used}.", "", "</details>", ""]
    return "\n".join(lines)


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(result: CheckResult) -> list[str]:
    """GitHub Actions workflow commands: ::error per regression, ::warning per inconclusive
    or weak verdict."""
    commands = []
    why = " ".join(explanation(result))
    for v in result.metrics:
        level = {"regression": "error", "inconclusive": "warning"}.get(v.outcome)
        if level is None and v.weak:
            level = "warning"
        if level is None:
            continue
        title = _escape_property(f"{TITLE}: {v.metric} {verdict_label(v)}")
        message = f"{v.metric}: {v.reason}"
        if v.outcome == "regression" and v.metric == "step_s" and why:
            message += f". {why}"
        commands.append(f"::{level} title={title}::{_escape_data(message)}")
    return commands
