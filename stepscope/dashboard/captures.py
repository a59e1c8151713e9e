"""Deep captures on the job page (#21): ask a rank for a torch.profiler capture, follow it,
see the culprit's and the reference's top operators side by side, download the traces."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import dash
import flask
from dash import Input, Output, State, dcc, html

from stepscope.dashboard import context, ids
from stepscope.pipeline.captures import BadCaptureRequest
from stepscope.query import JobNotFound
from stepscope.query.captures import CaptureRequest, TraceNotFound, capture_trace, job_captures
from stepscope.text import numbers

MAX_REQUESTS_SHOWN = 5
MAX_OPERATORS_SHOWN = 15
POLL_MS = 3_000
"""How often the panel is redrawn while a capture is on its way."""


def trace_href(job_id: str, capture_id: int) -> str:
    """The dashboard's download path of a trace (behind the dashboard's sign-in)."""
    return f"/jobs/{quote(job_id, safe='')}/captures/{capture_id}/trace"


def pending(requests: Sequence[CaptureRequest]) -> bool:
    """Some capture is not uploaded or failed yet."""
    return any(c["status"] in ("requested", "delivered") for r in requests for c in r.captures)


def capture_section_children(job_id: str, requests: Sequence[CaptureRequest]) -> list[Any]:
    """The form, its message line, the panel and the poll that keeps it current."""
    return [
        html.Div(
            [
                html.Label("rank", htmlFor=ids.JOB_CAPTURE_RANK),
                dcc.Input(id=ids.JOB_CAPTURE_RANK, type="number", min=0, step=1),
                html.Label("steps", htmlFor=ids.JOB_CAPTURE_STEPS),
                dcc.Input(id=ids.JOB_CAPTURE_STEPS, type="number", min=1, step=1, value=5),
                html.Button("Capture", id=ids.JOB_CAPTURE_GO, n_clicks=0),
            ],
            className="filters capture-form",
        ),
        html.P(id=ids.JOB_CAPTURE_MESSAGE, className="note"),
        html.Div(captures_panel(job_id, requests), id=ids.JOB_CAPTURES),
        dcc.Interval(id=ids.JOB_CAPTURES_POLL, interval=POLL_MS, disabled=not pending(requests)),
    ]


def captures_panel(job_id: str, requests: Sequence[CaptureRequest]) -> list[Any]:
    """Each recent request: its ranks (status, steps, download), then their operators side
    by side."""
    if not requests:
        return [html.P("No deep capture of this job yet.", className="empty")]
    return [_request(job_id, r) for r in requests[:MAX_REQUESTS_SHOWN]]


def _request(job_id: str, r: CaptureRequest) -> html.Div:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.requested_at))
    why = "asked from the API or dashboard" if r.reason == "user" else f"after a {r.reason}"
    head = html.Div(
        f"Capture {r.id} · {r.num_steps} steps · {why} · {when} UTC", className="capture-title"
    )
    ranks = html.Ul([_capture_item(job_id, c) for c in r.captures], className="capture-ranks")
    children: list[Any] = [head, ranks]
    if r.comparison:
        children.append(_comparison(r.comparison))
    return html.Div(children, className="capture", id=f"capture-{r.id}")


def _capture_item(job_id: str, c: dict[str, Any]) -> html.Li:
    parts: list[Any] = [f"rank {c['rank']} ({c['role']}): {c['status']}"]
    if c.get("first_step") is not None:
        parts.append(f", steps {c['first_step']:,}–{c['last_step']:,}")
    if c.get("error"):
        parts.append(f": {c['error']}")
    if c["status"] == "uploaded":
        size = numbers.integer(c.get("trace_bytes") or 0)
        parts += [" · ", html.A(f"trace ({size} bytes)", href=trace_href(job_id, c["id"]))]
    return html.Li(parts)


def _comparison(rows: Sequence[dict[str, Any]]) -> html.Table:
    head = html.Tr([html.Th(h) for h in ("operator", "culprit", "reference", "difference")])
    body = [
        html.Tr(
            [
                html.Td(d["name"], className="capture-op"),
                html.Td(numbers.seconds(d["culprit_s"])),
                html.Td(numbers.seconds(d["reference_s"])),
                html.Td(_signed_seconds(d["difference_s"])),
            ]
        )
        for d in rows[:MAX_OPERATORS_SHOWN]
    ]
    return html.Table([html.Thead(head), html.Tbody(body)], className="capture-compare")


def _signed_seconds(value_s: float) -> str:
    text = numbers.seconds(abs(value_s))
    return f"+{text}" if value_s >= 0 else f"−{text}"


def register_callbacks(app: dash.Dash) -> None:
    """The form's request, the panel's poll, and the trace downloads."""

    @app.callback(
        Output(ids.JOB_CAPTURE_MESSAGE, "children"),
        Output(ids.JOB_CAPTURES, "children", allow_duplicate=True),
        Output(ids.JOB_CAPTURES_POLL, "disabled", allow_duplicate=True),
        Input(ids.JOB_CAPTURE_GO, "n_clicks"),
        State(ids.JOB_CAPTURE_RANK, "value"),
        State(ids.JOB_CAPTURE_STEPS, "value"),
        State(ids.JOB_ID, "data"),
        prevent_initial_call=True,
    )
    def request_capture(_clicks: int, rank: Any, steps: Any, job_id: str) -> Any:
        desk = context.capture_desk()
        if desk is None or not context.may_request_captures():
            message = "Asking for a capture needs a token with the ingest or admin scope."
            return message, dash.no_update, dash.no_update
        if not isinstance(rank, int) or not isinstance(steps, int):
            return "Give a rank and a number of steps.", dash.no_update, dash.no_update
        try:
            request_id = desk.request(job_id, rank=rank, num_steps=steps)
        except (BadCaptureRequest, JobNotFound) as exc:
            return str(exc), dash.no_update, dash.no_update
        requests = job_captures(context.engine(), job_id)
        message = (
            f"Capture {request_id} asked: the ranks start at their next batch and upload when done."
        )
        return message, captures_panel(job_id, requests), False

    @app.callback(
        Output(ids.JOB_CAPTURES, "children"),
        Output(ids.JOB_CAPTURES_POLL, "disabled"),
        Input(ids.JOB_CAPTURES_POLL, "n_intervals"),
        State(ids.JOB_ID, "data"),
        prevent_initial_call=True,
    )
    def poll(_n: int, job_id: str) -> Any:
        requests = job_captures(context.engine(), job_id)
        return captures_panel(job_id, requests), not pending(requests)

    server: flask.Flask = app.server
    server.add_url_rule(
        "/jobs/<path:job_id>/captures/<int:capture_id>/trace",
        "capture_trace",
        _download,
    )


def _download(job_id: str, capture_id: int) -> flask.Response:
    """The trace as an attachment; 404 when the job has no such uploaded capture."""
    try:
        trace = capture_trace(context.engine(), capture_id, job_id=job_id)
    except TraceNotFound as exc:
        return flask.Response(str(exc), status=404, mimetype="text/plain")
    return flask.Response(
        trace.trace_gz,
        mimetype="application/gzip",
        headers={"Content-Disposition": f'attachment; filename="{trace.filename}"'},
    )
