"""`/`: every job in a sortable, filterable grid, read block by block as the user scrolls."""

from __future__ import annotations

import time
from typing import Any

import dash
import dash_ag_grid as dag
from dash import Input, Output, State, dcc, html

from stepscope import query
from stepscope.dashboard import context, data, ids
from stepscope.dashboard.components import job_href, message
from stepscope.dashboard.hangs import hang_banner
from stepscope.text import numbers

BLOCK_ROWS = 100
SEVERITIES = ("critical", "warning", "info")
_COLUMNS: list[dict[str, Any]] = [
    {"field": "name", "colId": "name", "headerName": "name", "flex": 2, "minWidth": 180,
     "filter": "agTextColumnFilter", "filterParams": {"filterOptions": ["contains"]}},
    {"field": "job_id", "colId": "job_id", "headerName": "job id", "sortable": False,
     "width": 200, "tooltipField": "job_id"},
    {"field": "status", "colId": "status", "sortable": False, "width": 110},
    {"field": "world_size", "colId": "world_size", "headerName": "world size", "width": 120},
    {"field": "num_nodes", "colId": "num_nodes", "headerName": "nodes", "width": 100},
    {"field": "started", "colId": "started_at", "headerName": "started", "width": 200},
    {"field": "duration", "colId": "duration", "sortable": False, "width": 110},
    {"field": "step_p50", "colId": "step_p50_s", "headerName": "step p50", "width": 120},
    {"field": "tokens_per_s", "colId": "tokens_per_s", "headerName": "tokens/s", "width": 120},
    {"field": "mfu", "colId": "mfu", "headerName": "MFU", "width": 100},
    {"field": "findings", "colId": "findings", "sortable": False, "flex": 1, "minWidth": 180,
     "cellClassRules": {
         "sev-critical": "params.data && params.data.num_critical > 0",
         "sev-warning": "params.data && !params.data.num_critical && params.data.num_warning > 0",
     }},
    {"field": "benchmark_key", "colId": "benchmark_key", "headerName": "benchmark key",
     "sortable": False, "width": 160, "filter": "agTextColumnFilter",
     "filterParams": {"filterOptions": ["equals"]}},
]  # fmt: skip


_PURGE = """function(statuses, severity) {
    const api = dash_ag_grid.getApi("GRID");
    if (api) { api.purgeInfiniteCache(); }
    return {};
}"""


def layout(**_query: str) -> html.Div:
    """The jobs grid and its filters (or how to get a first job)."""
    if not query.list_jobs(context.engine(), limit=1).jobs:
        return message(
            "No jobs yet",
            "Jobs appear here once a training process sends its first batch: call "
            "stepscope.init(job_id=..., url=<this server>) in the training script, or run "
            "`stepscope demo`.",
        )
    hangs = query.open_hangs(context.engine())
    return html.Div(
        [
            hang_banner(ids.JOBS_HANGS, [(f.job_id, f) for f in hangs], links=True),
            html.H1("Jobs"),
            html.Div(
                [
                    dcc.Dropdown(
                        id=ids.JOBS_STATUS,
                        options=list(query.JOB_STATUSES),
                        multi=True,
                        placeholder="any status",
                        className="filter",
                    ),
                    dcc.Dropdown(
                        id=ids.JOBS_SEVERITY,
                        options=[{"label": f"findings ≥ {s}", "value": s} for s in SEVERITIES],
                        placeholder="any findings",
                        className="filter",
                    ),
                ],
                className="filters",
            ),
            dcc.Store(id=ids.JOBS_CURSORS, data={}),
            dag.AgGrid(
                id=ids.JOBS_GRID,
                columnDefs=_COLUMNS,
                defaultColDef={
                    "sortable": True,
                    "resizable": True,
                    "floatingFilter": True,
                    "filter": False,
                    "suppressHeaderMenuButton": True,
                },
                rowModelType="infinite",
                getRowId="params.data.job_id",
                dashGridOptions={
                    "cacheBlockSize": BLOCK_ROWS,
                    "maxBlocksInCache": 20,
                    "infiniteInitialRowCount": 1,
                    "rowBuffer": 0,
                    "rowSelection": {"mode": "singleRow", "checkboxes": False},
                },
                className="jobs-grid",
                style={"height": "70vh"},
            ),  # fmt: skip
        ]
    )


def register_callbacks(app: dash.Dash) -> None:
    """The grid's rows, its filters, and opening a job."""

    @app.callback(
        Output(ids.JOBS_GRID, "getRowsResponse"),
        Output(ids.JOBS_CURSORS, "data"),
        Input(ids.JOBS_GRID, "getRowsRequest"),
        State(ids.JOBS_STATUS, "value"),
        State(ids.JOBS_SEVERITY, "value"),
        State(ids.JOBS_CURSORS, "data"),
        prevent_initial_call=True,
    )
    def rows(
        request: dict[str, Any] | None,
        statuses: list[str] | None,
        severity: str | None,
        cursors: dict[str, Any] | None,
    ) -> tuple[Any, Any]:
        if not request:
            return dash.no_update, dash.no_update
        filters = _filters(request.get("filterModel") or {}, statuses, severity)
        sort = _sort(request.get("sortModel") or [])
        key = f"{sort}|{filters!r}"
        known = (cursors or {}).get(key, {})
        block = data.jobs_block(
            context.engine(),
            filters,
            sort,
            int(request.get("startRow", 0)),
            int(request.get("endRow", BLOCK_ROWS)),
            known,
        )
        now = time.time()
        response = {"rowData": [_row(r, now) for r in block.rows], "rowCount": block.last_row}
        return response, {key: block.cursors}

    # New filters: the grid drops its cached blocks and asks for its rows again.
    app.clientside_callback(
        _PURGE.replace("GRID", ids.JOBS_GRID),
        Output(ids.JOBS_CURSORS, "data", allow_duplicate=True),
        Input(ids.JOBS_STATUS, "value"),
        Input(ids.JOBS_SEVERITY, "value"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output(ids.URL, "href", allow_duplicate=True),
        Input(ids.JOBS_GRID, "cellClicked"),
        prevent_initial_call=True,
    )
    def open_job(cell: dict[str, Any] | None) -> Any:
        if not cell or not cell.get("rowId"):
            return dash.no_update
        return job_href(str(cell["rowId"]))


def _filters(
    model: dict[str, Any], statuses: list[str] | None, severity: str | None
) -> query.JobFilters:
    def text(column: str) -> str | None:
        value = (model.get(column) or {}).get("filter")
        return str(value).strip() or None if value is not None else None

    return query.JobFilters(
        status=tuple(s for s in statuses or () if s in query.JOB_STATUSES),
        name_contains=text("name"),
        benchmark_key=text("benchmark_key"),
        min_severity=severity if severity in SEVERITIES else None,
    )


def _sort(model: list[dict[str, Any]]) -> str:
    for entry in model:
        column = entry.get("colId")
        if column in query.JOB_SORT_KEYS:
            return ("-" if entry.get("sort") == "desc" else "") + str(column)
    return "-started_at"


def _row(r: query.JobRow, now: float) -> dict[str, Any]:
    counts = [(r.num_critical, "critical"), (r.num_warning, "warning"), (r.num_info, "info")]
    badges = " · ".join(f"{n} {label}" for n, label in counts if n)
    analysed = r.num_info is not None
    return {
        "job_id": r.job_id,
        "name": r.name or r.job_id,
        "status": r.status,
        "world_size": r.world_size,
        "num_nodes": r.num_nodes,
        "started": numbers.when(r.started_at),
        "duration": numbers.seconds(data.job_duration_s(r, now)),
        "step_p50": numbers.seconds(r.step_p50_s),
        "tokens_per_s": numbers.rate(r.tokens_per_s),
        "mfu": numbers.share(r.mfu),
        "findings": badges or ("none" if analysed else "not analysed yet"),
        "num_critical": r.num_critical or 0,
        "num_warning": r.num_warning or 0,
        "benchmark_key": r.benchmark_key,
    }


dash.register_page(
    __name__, path="/", title="Jobs · stepscope", name="Jobs", order=0, layout=layout
)
