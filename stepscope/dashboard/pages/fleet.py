"""`/fleet`: node health across jobs: nodes × time, the top suspects with their evidence."""

from __future__ import annotations

from typing import Any

import dash
from dash import dcc, html

from stepscope.dashboard import components as ui
from stepscope.dashboard import context, ids
from stepscope.figures.fleet import fleet_figure
from stepscope.query import fleet
from stepscope.text.fleet import node_sentence
from stepscope.text.numbers import integer, share, signed_share, when

TOP_SUSPECTS = 10
EVIDENCE_JOBS = 5
"""Jobs listed per suspect: its slowest current ones, each a link."""


def layout(**_query: str) -> html.Div:
    """The fleet page."""
    engine = context.engine()
    page = fleet.list_nodes(engine, fleet.NodeFilters(suspect=True), limit=TOP_SUSPECTS)
    if page.num_nodes == 0:
        return ui.message(
            "No node levels yet",
            "Each analysed job stores how much slower each of its nodes was than its median "
            "rank; jobs of two nodes or more appear here once analysed.",
        )
    return html.Div(
        [
            html.H1("Fleet"),
            ui.cards(
                [
                    ("nodes", integer(page.num_nodes)),
                    ("jobs", integer(page.num_jobs)),
                    ("suspect nodes", integer(page.num_suspects)),
                    ("job-to-job noise of a node", share(page.tau)),
                ]
            ),
            ui.section(
                "Suspects",
                _suspects(engine, page.nodes),
                note="Nodes slower than the fleet's typical node in job after job (docs/fleet.md).",
            ),
            ui.section(
                "Nodes × time",
                ui.graph(ids.FLEET_HEATMAP, fleet_figure(fleet.fleet_map(engine))),
                note="Each node's excess over its jobs' median rank, per time bin: suspects "
                "first, then by effect.",
            ),
        ]
    )


def _suspects(engine: Any, nodes: list[dict[str, Any]]) -> Any:
    if not nodes:
        return html.P("No suspect node: no node is slow across its jobs.", className="note")
    head = html.Tr(
        [html.Th(h) for h in ("node", "effect", "confidence", "jobs", "since", "slowest jobs")]
    )
    body = []
    for n in nodes:
        detail = fleet.node_detail(engine, n["node"])
        worst = sorted(
            (j for j in detail.jobs if j.get("current")),
            key=lambda j: -(j.get("residual") or 0.0),
        )[:EVIDENCE_JOBS]
        links: list[Any] = []
        for j in worst:
            label = f"{j['name'] or j['job_id']} ({signed_share(j['residual'])})"
            links += [dcc.Link(label, href=ui.job_href(j["job_id"])), " "]
        body.append(
            html.Tr(
                [
                    html.Td(n["node"], title=node_sentence(n)),
                    html.Td(signed_share(n["effect"])),
                    html.Td(share(n["confidence"], 0)),
                    html.Td(f"{n['num_jobs']}/{n['num_jobs_total']}"),
                    html.Td(when(n["since"], short=True) if n["since"] else ""),
                    html.Td(links, className="evidence"),
                ]
            )
        )
    return html.Table(
        [html.Thead(head), html.Tbody(body)], className="table", id=ids.FLEET_SUSPECTS
    )


def register_callbacks(_app: dash.Dash) -> None:
    """None: the fleet page is drawn by its layout (links navigate)."""


dash.register_page(__name__, path="/fleet", title="Fleet · stepscope", order=3, layout=layout)
