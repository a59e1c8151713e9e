"""A hang in the dashboard (#19): a banner on the jobs list and the job page, and the job
page's panel (ranks by state: waiting in which collective, elsewhere, silent; then the
stacks, the culprit's first). Drawn from the open `hang` finding the hang monitor keeps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dash import dcc, html

from stepscope.analysis.hangs.culprits import rank_spans
from stepscope.dashboard.components import job_href, rank_href
from stepscope.schema import Finding
from stepscope.text.findings import hang_sentence
from stepscope.text.labels import hang_class

MAX_FRAMES_SHOWN = 40
"""Innermost frames of a stack shown; the outer ones (the launcher, main) rarely matter."""


def hang_banner(component_id: str, hangs: Sequence[tuple[str, Finding]], *, links: bool) -> Any:
    """An alert naming each (job id, open hang); an empty Div when nothing hangs."""
    if not hangs:
        return html.Div(id=component_id)
    items = []
    for job_id, f in hangs:
        sentence = hang_sentence(f)
        if links:
            line: Any = [dcc.Link(job_id, href=job_href(job_id), className="hang-job"), " · "]
            items.append(html.Li([*line, sentence]))
        else:
            items.append(html.Li(sentence))
    return html.Div(
        [html.Strong("Hanging now"), html.Ul(items)],
        id=component_id,
        className="hang-banner",
        role="alert",
    )


def hang_panel(job_id: str, f: Finding | None) -> Any:
    """Ranks by state and the stacks of an open hang (nothing when there is none)."""
    if f is None:
        return []
    e = f.evidence or {}
    state = e.get("ranks_by_state") or {}
    rows = [
        _row("waiting", label, w.get("ranks", ""), w.get("num_ranks"))
        for label, w in (state.get("waiting") or {}).items()
    ]
    for name in ("elsewhere", "silent"):
        ranks = state.get(name) or []
        if ranks:
            rows.append(_row(name, "", rank_spans(ranks), state.get(f"num_{name}", len(ranks))))
    table = html.Table(
        [
            html.Thead(html.Tr([html.Th(h) for h in ("state", "collective", "ranks", "count")])),
            html.Tbody(rows),
        ],
        className="hang-states",
    )
    culprit = f"{hang_class(str(e.get('class', '')), long=True)}: "
    culprit += ", ".join(f"rank {r}" for r in f.ranks[:8])
    stacks: list[Any] = [html.H4("Stacks, innermost call last")]
    stacks += _stack(
        "hang-stack-culprit",
        f"{culprit} ({e.get('stack_source') or 'no stack'})",
        e.get("culprit_stack"),
        [dcc.Link(f"rank {f.ranks[0]}", href=rank_href(job_id, f.ranks[0]))] if f.ranks else [],
    )
    stacks += _stack(
        "hang-stack-majority", "The majority of hanging ranks", e.get("majority_stack")
    )
    for i, outlier in enumerate(e.get("outlier_stacks") or []):
        ranks = ", ".join(map(str, outlier.get("ranks", [])))
        title = f"{outlier.get('num_ranks')} rank(s): {ranks}"
        stacks += _stack(f"hang-stack-outlier-{i}", title, outlier.get("stack"))
    return [table, *stacks]


def _row(state: str, collective: str, ranks: str, count: Any) -> html.Tr:
    return html.Tr(
        [html.Td(state), html.Td(collective), html.Td(ranks), html.Td(str(count or ""))],
        className=f"hang-state-{state}",
    )


def _stack(
    css_id: str, title: str, frames: list[dict[str, Any]] | None, extra: list[Any] | None = None
) -> list[Any]:
    if not frames:
        return [html.Div([html.Div(title, className="hang-stack-title"), "no stack"])]
    shown = frames[-MAX_FRAMES_SHOWN:]
    lines = [f"{fr.get('function')}  {fr.get('file')}:{fr.get('line')}" for fr in shown]
    if len(frames) > len(shown):
        lines.insert(0, f"… {len(frames) - len(shown)} outer frames")
    head: list[Any] = [html.Span(title)]
    if extra:
        head += [" · ", *extra]
    return [
        html.Div(
            [html.Div(head, className="hang-stack-title"), html.Pre("\n".join(lines))],
            id=css_id,
            className="hang-stack",
        )
    ]
