"""`/compare?baseline=…&candidate=…`: two jobs overlaid, with their differences."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import dash
from dash import Input, Output, State, dcc, html

from stepscope import figures, query
from stepscope.dashboard import components as ui
from stepscope.dashboard import context, data, ids
from stepscope.text import numbers

_LABELS = {
    "step_p50_s": "step time p50",
    "step_p90_s": "step time p90",
    "tokens_per_s": "tokens/s",
    "samples_per_s": "samples/s",
    "mfu": "MFU",
}


def layout(baseline: str = "", candidate: str = "", **_query: str) -> html.Div:
    """The two job ids to compare, and the comparison once both are given."""
    form = html.Div(
        [
            dcc.Input(
                id=ids.COMPARE_BASELINE,
                value=baseline,
                placeholder="baseline job id",
                debounce=True,
                className="text-input",
            ),
            dcc.Input(
                id=ids.COMPARE_CANDIDATE,
                value=candidate,
                placeholder="candidate job id",
                debounce=True,
                className="text-input",
            ),
            html.Button("Compare", id=ids.COMPARE_GO, n_clicks=0),
        ],  # fmt: skip
        className="filters",
    )
    return html.Div([html.H1("Compare two jobs"), form, _comparison(baseline, candidate)])


def _comparison(baseline: str, candidate: str) -> Any:
    if not baseline or not candidate:
        return html.P("Enter a baseline and a candidate job id.", className="note")
    try:
        page = data.compare_page(context.engine(), baseline, candidate)
    except query.JobNotFound as exc:
        return ui.message(f"No job {exc.job_id!r} is stored", kind="error")
    c = page.comparison
    names = (
        f"baseline {c.baseline.name or baseline}",
        f"candidate {c.candidate.name or candidate}",
    )
    warning = (
        None
        if c.same_benchmark_key
        else html.Div(
            "The jobs have different (or no) benchmark keys: they may not be comparable.",
            className="note-box",
        )
    )
    components = [(d.component, d.seconds.baseline, d.seconds.candidate) for d in c.components]
    return html.Div(
        [
            warning,
            html.Div(
                [
                    dcc.Link(names[0], href=ui.job_href(baseline)),
                    " against ",
                    dcc.Link(names[1], href=ui.job_href(candidate)),
                ],
                className="subtitle",
            ),
            ui.section("Differences", _table(c)),
            ui.graph(
                ids.COMPARE_STEP,
                figures.overlay_figure(
                    *page.step_s, names=names, title="median step time", unit="s"
                ),
            ),
            ui.graph(
                ids.COMPARE_RATES,
                figures.overlay_figure(
                    *page.tokens, names=names, title="tokens/s", unit="tokens/s"
                ),
            ),
            ui.graph(ids.COMPARE_COMPONENTS, figures.components_figure(components, names=names)),
        ]  # fmt: skip
    )


def _table(c: query.Comparison) -> html.Table:
    rows = []
    for d in c.metrics:
        better = None
        if d.relative is not None and d.higher_is_better is not None and d.relative != 0:
            better = (d.relative > 0) == d.higher_is_better
        show = (numbers.share if d.name == "mfu" else numbers.rate if d.name.endswith("_per_s")
                else numbers.seconds)  # fmt: skip
        rows.append(_tr(_LABELS.get(d.name, d.name), show(d.baseline), show(d.candidate),
                        d.relative, better))  # fmt: skip
    for comp in c.components:
        s, share = comp.seconds, comp.share
        better = None if not s.relative else s.relative < 0
        rows.append(
            _tr(
                f"{comp.component.replace('_', ' ')} per step",
                f"{numbers.seconds(s.baseline)} ({numbers.share(share.baseline)})",
                f"{numbers.seconds(s.candidate)} ({numbers.share(share.candidate)})",
                s.relative,
                better,
            )
        )
    head = html.Tr([html.Th(h) for h in ("", "baseline", "candidate", "change")])
    return html.Table([html.Thead(head), html.Tbody(rows)], className="table")


def _tr(label: str, base: str, cand: str, relative: float | None, better: bool | None) -> html.Tr:
    tone = "" if better is None else ("better" if better else "worse")
    return html.Tr(
        [
            html.Td(label),
            html.Td(base),
            html.Td(cand),
            html.Td(numbers.signed_share(relative), className=tone),
        ]  # fmt: skip
    )


def register_callbacks(app: dash.Dash) -> None:
    """The form navigates to the comparison of the two ids."""

    @app.callback(
        Output(ids.URL, "href", allow_duplicate=True),
        Input(ids.COMPARE_GO, "n_clicks"),
        State(ids.COMPARE_BASELINE, "value"),
        State(ids.COMPARE_CANDIDATE, "value"),
        prevent_initial_call=True,
    )
    def go(_clicks: int, baseline: str | None, candidate: str | None) -> Any:
        if not baseline or not candidate:
            return dash.no_update
        return "/compare?" + urlencode(
            {"baseline": baseline.strip(), "candidate": candidate.strip()}
        )


dash.register_page(
    __name__,
    path="/compare",
    title="Compare · stepscope",
    name="Compare",
    order=3,
    layout=layout,
)
