"""`/jobs/<job_id>`: one job: cards, band, rates, heatmap, ranks, findings, collectives, GPU."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import dash
from dash import Input, Output, State, dcc, html

from stepscope import figures, query
from stepscope.dashboard import components as ui
from stepscope.dashboard import context, data, ids, live
from stepscope.dashboard.captures import capture_section_children
from stepscope.dashboard.gestures import clicked_rank, step_range
from stepscope.dashboard.hangs import hang_banner, hang_panel
from stepscope.query.captures import job_captures
from stepscope.query.goodput import JobGoodput
from stepscope.text.goodput import top_badput
from stepscope.text.labels import component, mesh_dim
from stepscope.text.numbers import share

HEATMAP_METRICS = {
    m: component(m, long=True) for m in ("compute_s", "step_s", "data_s", "comm_wait_s")
}
STEP_AXIS_ONLY = """(relayout) => Object.keys(relayout || {}).some((k) => k.startsWith("xaxis."))
    ? relayout : window.dash_clientside.no_update"""
"""Passes on a heatmap relayout that moved the step axis (a zoom or its reset), no other."""


def group_by_options(mesh: query.Mesh) -> list[dict[str, str]]:
    """The "group by" choices of a job: each rank, each node, each mesh dimension it has."""
    names = {"rank": "each rank", "node": "by node"}
    return [
        {"label": names.get(g) or f"by {mesh_dim(g, long=True)} ({g})", "value": g}
        for g in mesh.group_by
    ]


def _group_by(component_id: str, mesh: query.Mesh) -> dcc.Dropdown:
    return dcc.Dropdown(
        id=component_id,
        options=group_by_options(mesh),
        value="rank",
        clearable=False,
        className="filter",
    )


def _goodput_section(answer: JobGoodput) -> html.Section:
    """The goodput card (share, GPU-hours lost, restarts, top causes) and its chart."""
    g = answer.result
    lost_h = (g.total_s - g.categories["productive"]) / 3600
    causes = top_badput(g.categories, g.total_s, answer.responsible)
    return ui.section(
        "Goodput",
        html.Div(
            [
                ui.card("goodput", share(g.goodput) if g.total_s > 0 else "–"),
                ui.card("GPU-hours lost", f"{lost_h:,.2f}"),
                ui.card("restarts", str(max(0, len(g.incarnations) - 1))),
            ],
            className="cards",
        ),
        html.P(
            "Top badput: " + ", ".join(causes) if causes else "No badput measured yet.",
            id=ids.JOB_GOODPUT_CAUSES,
        ),
        ui.graph(ids.JOB_GOODPUT, figures.goodput_figure(answer)),
        ui.graph(ids.JOB_GOODPUT_TIME, figures.goodput_time_figure(answer)),
        note="Every GPU-second of the job in one category, per incarnation (a restart starts "
        "a new bar) and over time (dashed: a restart's processes began); see docs/goodput.md.",
    )


def layout(job_id: str = "", **_query: str) -> html.Div:
    """The job page, every figure drawn from one round of reads."""
    try:
        page = data.job_page(context.engine(), job_id)
    except query.JobNotFound:
        return ui.message(
            f"No job {job_id!r} is stored",
            "Check the job id, or pick the job from the jobs list. A job appears once one "
            "of its ranks has sent a batch.",
            kind="error",
        )
    s = page.summary
    hang = query.open_hang(page.findings)
    return html.Div(
        [
            hang_banner(ids.JOB_HANG_BANNER, [(job_id, hang)] if hang else [], links=False),
            dcc.Store(id=ids.JOB_ID, data=job_id),
            dcc.Store(id=ids.JOB_LIVE_STATE, data=live.initial_state(page)),
            dcc.Store(id=ids.JOB_HEATMAP_ZOOM),
            dcc.Interval(
                id=ids.JOB_LIVE, interval=live.INTERVAL_MS, disabled=s.status != "running"
            ),
            html.Div(
                [dcc.Link("Jobs", href="/"), " › ", html.Span(s.name or s.job_id)],
                className="crumbs",
            ),
            html.H1(s.name or s.job_id),
            html.Div(
                [
                    html.Span(f"job id {s.job_id}", className="job-id"),
                    html.Span(live.last_update_text(s), id=ids.JOB_LAST_UPDATE),
                    dcc.Link(
                        "Compare with another job…",
                        href=f"/compare?baseline={quote(s.job_id, safe='')}",
                    ),
                ],
                className="subtitle",
            ),
            html.Div(live.status_note(s), id=ids.JOB_STATUS_NOTE),
            html.Div(live.header_cards(s), id=ids.JOB_CARDS),
            ui.section(
                "Hang",
                html.Div(hang_panel(job_id, hang), id=ids.JOB_HANG),
                note="Ranks by state while the job hangs, then the stacks, the culprit's first.",
                hidden=hang is None,
            ),
            ui.section(
                "Findings",
                html.Div(ui.findings_list(job_id, page.findings), id=ids.JOB_FINDINGS),
            ),
            _goodput_section(page.goodput) if page.goodput is not None else None,
            ui.section(
                "Step time across ranks",
                ui.graph(ids.JOB_BAND, figures.band_figure(page.band, page.findings, page.events)),
                note="Min, median and max over ranks per step; ▼ findings, × events.",
            ),
            ui.section(
                "Throughput and MFU",
                ui.graph(
                    ids.JOB_THROUGHPUT, figures.rates_figure(page.tokens, page.mfu, page.findings)
                ),
                note="Dashed lines: change points found by the analysis.",
            ),
            ui.section(
                "Rank × step heatmap",
                html.Div(
                    [
                        dcc.Dropdown(
                            id=ids.JOB_HEATMAP_METRIC,
                            options=[{"label": v, "value": k} for k, v in HEATMAP_METRICS.items()],
                            value="compute_s",
                            clearable=False,
                            className="filter",
                        ),
                        dcc.Dropdown(
                            id=ids.JOB_HEATMAP_STAT,
                            options=[
                                {"label": "mean per cell", "value": "mean"},
                                {"label": "max per cell", "value": "max"},
                            ],
                            value="mean",
                            clearable=False,
                            className="filter",
                        ),
                        _group_by(ids.JOB_HEATMAP_GROUP_BY, page.mesh),
                    ],
                    className="filters",
                ),
                ui.graph(ids.JOB_HEATMAP, figures.heatmap_figure(page.heatmap)),
                note="Ranks grouped by node; grouped, a row is the mean over a node's ranks or "
                "over the ranks at one mesh coordinate. Zoom to re-read finer steps; "
                "double-click to reset; click a row to open its rank.",
            ),
            ui.section(
                "Where each rank's time goes",
                html.Div([_group_by(ids.JOB_BREAKDOWN_GROUP_BY, page.mesh)], className="filters"),
                ui.graph(ids.JOB_BREAKDOWN, figures.breakdown_figure(page.ranks)),
                note="The slowest ranks first (by their own work: data + compute); grouped, "
                "each group's median rank. Click a bar to open the rank (a group's slowest).",
            ),
            ui.section(
                "Collectives",
                ui.graph(ids.JOB_COLLECTIVES, figures.collectives_figure(page.collectives)),
                note="Per process group (its mesh dimension: every tp group is tp) and op.",
            ),
            ui.section(
                "GPU telemetry across devices",
                ui.graph(ids.JOB_GPU, figures.gpu_figure(page.gpu)),
            ),
            ui.section(
                "Deep captures",
                *capture_section_children(job_id, job_captures(context.engine(), job_id)),
                note="torch.profiler on a rank and a reference rank for a few steps, asked "
                "after a straggler or hang or from here (scope ingest or admin); their top "
                "operators side by side. Open a trace in ui.perfetto.dev.",
            ),
        ]
    )


def register_callbacks(app: dash.Dash) -> None:
    """Heatmap re-reads (metric, statistic, grouping, zoom), the breakdown's grouping, and
    clicks that open a rank."""
    # Only a relayout of the step axis goes to the server: plotly reports one too when a
    # graph sizes itself after its first draw, a round trip at every page load.
    app.clientside_callback(
        STEP_AXIS_ONLY,
        Output(ids.JOB_HEATMAP_ZOOM, "data"),
        Input(ids.JOB_HEATMAP, "relayoutData"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output(ids.JOB_HEATMAP, "figure"),
        Input(ids.JOB_HEATMAP_METRIC, "value"),
        Input(ids.JOB_HEATMAP_STAT, "value"),
        Input(ids.JOB_HEATMAP_GROUP_BY, "value"),
        Input(ids.JOB_HEATMAP_ZOOM, "data"),
        State(ids.JOB_ID, "data"),
        prevent_initial_call=True,
    )
    def reread_heatmap(
        metric: str, stat: str, group_by: str, relayout: dict[str, Any] | None, job_id: str
    ) -> Any:
        zoomed = dash.ctx.triggered_id == ids.JOB_HEATMAP_ZOOM
        zoom = step_range(relayout) if zoomed else None
        if zoomed and zoom is None:
            return dash.no_update  # a relayout that changed no step range
        from_step, to_step = zoom if zoom else (None, None)
        engine = context.engine()
        try:
            world_size = query.job_summary(engine, job_id).world_size
            grid = data.heatmap(
                engine,
                job_id,
                world_size,
                metric=metric,
                stat=stat,
                group_by=group_by,
                from_step=from_step,
                to_step=to_step,
            )
        except (query.JobNotFound, ValueError) as exc:
            return figures.message_figure(str(exc))
        return figures.heatmap_figure(grid)

    @app.callback(
        Output(ids.JOB_BREAKDOWN, "figure"),
        Input(ids.JOB_BREAKDOWN_GROUP_BY, "value"),
        State(ids.JOB_ID, "data"),
        prevent_initial_call=True,
    )
    def regroup_breakdown(group_by: str, job_id: str) -> Any:
        try:
            table = data.breakdown(context.engine(), job_id, group_by)
        except (query.JobNotFound, ValueError) as exc:
            return figures.message_figure(str(exc))
        return figures.breakdown_figure(table)

    @app.callback(
        Output(ids.URL, "href", allow_duplicate=True),
        Input(ids.JOB_BREAKDOWN, "clickData"),
        Input(ids.JOB_HEATMAP, "clickData"),
        State(ids.JOB_ID, "data"),
        prevent_initial_call=True,
    )
    def open_rank(bar: Any, cell: Any, job_id: str) -> Any:
        rank = clicked_rank(bar if dash.ctx.triggered_id == ids.JOB_BREAKDOWN else cell)
        return dash.no_update if rank is None else ui.rank_href(job_id, rank)


dash.register_page(
    __name__, path_template="/jobs/<job_id>", title="Job · stepscope", order=2, layout=layout
)
