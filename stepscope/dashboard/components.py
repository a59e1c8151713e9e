"""Layout pieces every page uses: the shell, cards, messages, the findings list.

Every user-provided string goes in as a component's text child (React escapes it); no
Markdown, no dangerouslySetInnerHTML.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import dash
from dash import dcc, html

from stepscope.dashboard import ids, signin
from stepscope.schema import Finding
from stepscope.text.findings import FindingText, finding_text, subject
from stepscope.text.numbers import known

_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def shell(*, auth: bool) -> html.Div:
    """The app's frame: navigation bar, the navigation Location, the page container."""
    links: list[Any] = [
        dcc.Link("stepscope", href="/", className="brand"),
        dcc.Link("Jobs", href="/", className="nav-link"),
        dcc.Link("Compare", href="/compare", className="nav-link"),
        dcc.Link("Fleet", href="/fleet", className="nav-link"),
    ]
    if auth:
        links.append(
            html.Form(
                html.Button("Sign out", type="submit", className="link-button"),
                action=signin.SIGN_OUT,
                method="POST",
                className="nav-right",
            )
        )
    return html.Div(
        [
            dcc.Location(id=ids.URL, refresh="callback-nav"),
            html.Nav(links, className="nav"),
            html.Main(dash.page_container, className="page"),
        ]
    )


def job_href(job_id: str) -> str:
    """The job page's path."""
    return f"/jobs/{quote(job_id, safe='')}"


def rank_href(job_id: str, rank: int) -> str:
    """The rank page's path."""
    return f"{job_href(job_id)}/ranks/{rank}"


def message(title: str, detail: str | None = None, *, kind: str = "info") -> html.Div:
    """A readable empty or error state: what is the matter, and what to do."""
    children: list[Any] = [html.H2(title)]
    if detail:
        children.append(html.P(detail))
    children.append(dcc.Link("Back to the jobs list", href="/"))
    return html.Div(children, className=f"message message-{kind}", role="status")


def card(label: str, value: str, hint: str | None = None) -> html.Div:
    """A header card: a figure and what it is."""
    return html.Div(
        [html.Div(value, className="card-value"), html.Div(label, className="card-label")],
        className="card",
        title=hint,
    )


def cards(items: Sequence[tuple[str, str]]) -> html.Div:
    """A row of header cards."""
    return html.Div([card(label, value) for label, value in items], className="cards")


def section(
    title: str, *children: Any, note: str | None = None, hidden: bool = False
) -> html.Section:
    """A titled block of the page."""
    head: list[Any] = [html.H3(title)]
    if note:
        head.append(html.P(note, className="note"))
    return html.Section([*head, *children], className="section", hidden=hidden)


def graph(component_id: str, figure: Any) -> dcc.Graph:
    """A graph without plotly's logo and with its toolbar on hover.

    Not responsive: a graph keeps the width it first drew at when the window is resized,
    where a responsive one sizes itself twice at every page load (~0.2 s for a job page).
    """
    return dcc.Graph(
        id=component_id,
        figure=figure,
        config={"displaylogo": False},
        className="graph",
    )


def findings_list(job_id: str, findings: Sequence[Finding]) -> html.P | html.Ul:
    """The findings in plain words, most severe first; ranks link to their pages."""
    if not findings:
        return html.P("No findings: nothing slow or wrong was detected.", className="note")
    ranked = sorted(findings, key=finding_order)
    return html.Ul([_finding_item(job_id, finding_text(f)) for f in ranked], className="findings")


def finding_order(f: Finding) -> tuple[int, float, int]:
    """Most severe first, then the largest effect, then the earliest."""
    effect = abs(f.effect) if known(f.effect) else 0.0
    return _SEVERITY_ORDER.get(f.severity, 3), -effect, f.first_step or 0


def _finding_item(job_id: str, t: FindingText) -> html.Li:
    head: list[Any] = [html.Span(t.severity, className=f"badge badge-{t.severity}"), " "]
    head.append(html.Strong(t.title))
    head.append(" – ")
    if len(t.ranks) == 1:
        head.append(dcc.Link(subject(t), href=rank_href(job_id, t.ranks[0]), className="rank"))
    else:
        head.append(html.Span(subject(t)))
    head.append(f", {t.when}")
    facts = [
        f"Cause: {t.cause}." if t.cause else None,
        f"Effect: {t.effect}." if t.effect else None,
        f"It {t.cost}." if t.cost else None,
    ]
    body: list[Any] = [html.Div(head, className="finding-head")]
    body.append(html.Div(" ".join(f for f in facts if f), className="finding-facts"))
    if t.evidence:
        body.append(html.Ul([html.Li(line) for line in t.evidence], className="evidence"))
    if len(t.ranks) > 1:
        body.append(html.Div(["Ranks: ", *_rank_links(job_id, t.ranks)], className="finding-ranks"))
    return html.Li(body, className=f"finding finding-{t.severity}")


def _rank_links(job_id: str, ranks: Sequence[int], limit: int = 32) -> list[Any]:
    links: list[Any] = []
    for r in ranks[:limit]:
        links.extend([dcc.Link(str(r), href=rank_href(job_id, r), className="rank"), " "])
    if len(ranks) > limit:
        links.append(f"and {len(ranks) - limit} more")
    return links
