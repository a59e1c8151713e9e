"""`/jobs/<job_id>/ranks/<rank>`: one rank against the job's median rank."""

from __future__ import annotations

from typing import Any

import dash
import numpy as np
from dash import dcc, html

from stepscope import figures, query
from stepscope.dashboard import components as ui
from stepscope.dashboard import context, data, ids
from stepscope.text import numbers
from stepscope.text.labels import component

_METRICS = tuple((m, component(m)) for m in ("step_s", "compute_s", "data_s", "comm_wait_s"))


def layout(job_id: str = "", rank: str = "", **_query: str) -> html.Div:
    """The rank page."""
    if not rank.isdigit():
        return ui.message(f"{rank!r} is not a rank", "Ranks are whole numbers.", kind="error")
    try:
        page = data.rank_page(context.engine(), job_id, int(rank))
    except query.JobNotFound:
        return ui.message(f"No job {job_id!r} is stored", kind="error")
    except ValueError as exc:
        return ui.message(f"Rank {rank} of job {job_id!r} has sent nothing", str(exc), kind="error")
    s = page.summary
    job_name = s.name or s.job_id
    node = f" on {page.node}" if page.node else ""
    return html.Div(
        [
            html.Div(
                [
                    dcc.Link("Jobs", href="/"),
                    " › ",
                    dcc.Link(job_name, href=ui.job_href(job_id)),
                    " › ",
                    html.Span(f"rank {page.rank}"),
                ],
                className="crumbs",
            ),
            html.H1(f"Rank {page.rank}{node}"),
            html.Div(_against_median(page), className="cards"),
            ui.section(
                "Findings naming this rank or its node", ui.findings_list(job_id, page.findings)
            ),  # fmt: skip
            ui.section(
                "Time components over steps",
                ui.graph(ids.RANK_METRICS, figures.rank_figure(page.rank, page.mine, page.job)),
                note="This rank (red) against the job's median rank (grey) per step.",
            ),
            ui.section("GPU samples", ui.graph(ids.RANK_GPU, figures.gpu_figure(page.gpu))),
            ui.section(f"Other ranks{node}", _peers(job_id, page)),
        ]
    )


def _row(page: data.RankPage) -> int | None:
    at = np.flatnonzero(page.table.rank == page.rank)
    return int(at[0]) if at.size else None


def _against_median(page: data.RankPage) -> list[Any]:
    i = _row(page)
    if i is None:
        return [ui.card("steps", "none rolled up yet")]
    t = page.table
    cards = []
    for metric, label in _METRICS:
        mine = float(t.median[metric][i])
        median = mine - float(t.excess_s[metric][i])
        relative = mine / median - 1.0 if numbers.known(median) and median > 0 else None
        cards.append(
            ui.card(
                f"{label} (job median {numbers.seconds(median)})",
                f"{numbers.seconds(mine)} ({numbers.signed_share(relative)})",
            )
        )
    cards.append(ui.card("slowest rank in", numbers.share(float(t.slowest_share[i])) + " of steps"))
    return cards


def _peers(job_id: str, page: data.RankPage) -> Any:
    if page.node is None:
        return html.P("The rank's node is unknown.", className="note")
    t = page.table
    rows = [i for i, n in enumerate(t.node) if n == page.node and int(t.rank[i]) != page.rank]
    if not rows:
        return html.P("No other rank on this node.", className="note")
    head = html.Tr([html.Th(h) for h in ("rank", "step p50", "compute", "data", "comm wait",
                                         "step vs job")])  # fmt: skip
    body = [
        html.Tr(
            [
                html.Td(dcc.Link(str(int(t.rank[i])), href=ui.rank_href(job_id, int(t.rank[i])))),
                *(html.Td(numbers.seconds(float(t.median[m][i]))) for m, _ in _METRICS),
                html.Td(numbers.signed_share(float(t.step_excess[i]))),
            ]
        )
        for i in rows
    ]
    return html.Table([html.Thead(head), html.Tbody(body)], className="table")


def register_callbacks(_app: dash.Dash) -> None:
    """None: the rank page is drawn by its layout (links navigate)."""


dash.register_page(
    __name__,
    path_template="/jobs/<job_id>/ranks/<rank>",
    title="Rank · stepscope",
    order=1,
    layout=layout,
)
