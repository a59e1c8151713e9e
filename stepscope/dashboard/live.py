"""The job page while its job runs: header, notes, and a refresh that reads only new steps.

Each refresh appends the new steps to the band, rate and heatmap figures as extra traces
(a Patch, so nothing already drawn is sent again); after MAX_SEGMENTS appends, or when a
figure had nothing to append to, the page's figures are drawn anew from the rollups.
"""

from __future__ import annotations

import time
from typing import Any

import dash
from dash import Input, Output, Patch, State, html

from stepscope import figures, query
from stepscope.analysis.config import AnalysisConfig
from stepscope.dashboard import components as ui
from stepscope.dashboard import context, data, ids
from stepscope.text import numbers

INTERVAL_MS = 10_000
MAX_SEGMENTS = 30
_CONFIG = AnalysisConfig()
WARMUP_STEPS = _CONFIG.warmup_steps + _CONFIG.window_steps
"""Steps before the analysis can say anything about stragglers."""


def initial_state(page: data.JobPage) -> dict[str, Any]:
    """What the live refresh starts from: the last step drawn, the heatmap's last column."""
    hm = page.heatmap
    return {
        "last_step": int(page.band.step[-1]) if page.band.step.size else None,
        "heatmap_from": int(hm.step_edges[-2])
        if hm is not None and hm.step_edges.size > 1
        else None,
        "segments": 0,
    }


def last_update_text(s: query.JobSummary) -> str:
    """'Last update 12:00:03 UTC · steps to 1,234 · last batch 2.1 s ago'."""
    now = time.time()
    parts = [f"Last update {time.strftime('%H:%M:%S', time.gmtime(now))} UTC"]
    if s.last_step is not None:
        parts.append(f"steps to {s.last_step:,}")
    if s.last_seen is not None:
        parts.append(f"last batch {numbers.ago(s.last_seen, now)}")
    return " · ".join(parts)


def status_note(s: query.JobSummary) -> html.Div | None:
    """Why the page may look empty, early or incomplete: no steps yet, not analysed, warming
    up, stale; and records the profilers dropped."""
    notes = [note for note in (_progress_note(s), _dropped_note(s)) if note is not None]
    return html.Div(notes) if notes else None


def _dropped_note(s: query.JobSummary) -> html.Div | None:
    if not s.num_records_dropped:
        return None
    note = (
        f"The profilers dropped {numbers.integer(s.num_records_dropped)} records (their "
        "buffers filled while the collector was unreachable): the figures miss them."
    )
    return html.Div(note, className="note-box", role="alert")


def _progress_note(s: query.JobSummary) -> html.Div | None:
    if not s.num_steps:
        note = (
            "No step has been rolled up yet: the job has sent nothing, or the analyzer has not "
            "run since it did. Figures appear after the analyzer's next pass."
        )
    elif s.analysed_at is None:
        note = "Not analysed yet: figures and findings appear after the analyzer's first pass."
    elif s.status == "running" and s.num_steps < WARMUP_STEPS:
        note = (
            f"Warming up: {s.num_steps} of the {WARMUP_STEPS} steps the analysis needs before "
            "it can name a straggler."
        )
    elif s.status == "stale":
        note = "No batch arrived for a while: the job may have stopped without saying so."
    else:
        return None
    return html.Div(note, className="note-box", role="status")


def header_cards(s: query.JobSummary) -> html.Div:
    """Status, size, step time, throughput, MFU, data and comm-wait shares, device."""
    size = f"{numbers.integer(s.world_size or s.num_ranks_seen)} / {numbers.integer(s.num_nodes)}"
    mfu = numbers.share(s.mfu) if s.peak_flops else "unknown (no peak)"
    return ui.cards(
        [
            ("status", s.status),
            ("ranks / nodes", size),
            ("step time p50", numbers.seconds(s.step_p50_s)),
            ("tokens/s", numbers.rate(s.tokens_per_s)),
            ("MFU", mfu),
            ("data wait", numbers.share(s.data_share)),
            ("comm wait", numbers.share(s.comm_wait_share)),
            ("device", s.device_name or numbers.UNKNOWN),
        ]
    )


def register_callbacks(app: dash.Dash) -> None:
    """The live refresh of the job page."""

    @app.callback(
        Output(ids.JOB_BAND, "figure", allow_duplicate=True),
        Output(ids.JOB_THROUGHPUT, "figure", allow_duplicate=True),
        Output(ids.JOB_HEATMAP, "figure", allow_duplicate=True),
        Output(ids.JOB_CARDS, "children"),
        Output(ids.JOB_FINDINGS, "children"),
        Output(ids.JOB_LAST_UPDATE, "children"),
        Output(ids.JOB_STATUS_NOTE, "children"),
        Output(ids.JOB_LIVE_STATE, "data"),
        Output(ids.JOB_LIVE, "disabled"),
        Input(ids.JOB_LIVE, "n_intervals"),
        State(ids.JOB_ID, "data"),
        State(ids.JOB_LIVE_STATE, "data"),
        State(ids.JOB_HEATMAP_METRIC, "value"),
        State(ids.JOB_HEATMAP_STAT, "value"),
        State(ids.JOB_HEATMAP_GROUP_BY, "value"),
        prevent_initial_call=True,
    )
    def refresh(
        _n: int, job_id: str, state: dict[str, Any], metric: str, stat: str, group_by: str
    ) -> tuple[Any, ...]:
        engine = context.engine()
        try:
            return _refresh(engine, job_id, state, (metric, stat, group_by or "rank"))
        except query.JobNotFound:
            gone = ui.message(f"Job {job_id!r} was deleted", kind="error")
            nothing = dash.no_update
            return nothing, nothing, nothing, gone, nothing, nothing, nothing, nothing, True


def _refresh(
    engine: Any, job_id: str, state: dict[str, Any], heatmap: tuple[str, str, str]
) -> tuple[Any, ...]:
    """The refresh's outputs; `heatmap` is the heatmap's (metric, stat, group_by)."""
    metric, stat, group_by = heatmap
    last, segments = state.get("last_step"), int(state.get("segments", 0)) + 1
    if last is None or segments > MAX_SEGMENTS:
        page = data.job_page(engine, job_id, with_goodput=False)
        s = page.summary
        return (
            figures.band_figure(page.band, page.findings, page.events),
            figures.rates_figure(page.tokens, page.mfu, page.findings),
            figures.heatmap_figure(
                data.heatmap(
                    engine, job_id, s.world_size, metric=metric, stat=stat, group_by=group_by
                )
            ),
            header_cards(s),
            ui.findings_list(job_id, page.findings),
            last_update_text(s),
            status_note(s),
            initial_state(page),
            s.status != "running",
        )
    heatmap_from = state.get("heatmap_from") or last + 1
    new = data.live_update(
        engine, job_id, after_step=int(last), heatmap_from=int(heatmap_from), metric=metric,
        stat=stat, group_by=group_by,
    )  # fmt: skip
    s = new.summary
    band: Any = dash.no_update
    rates: Any = dash.no_update
    grid: Any = dash.no_update
    next_state = dict(state)
    if new.band.step.size:
        band = Patch()
        band["data"].extend(figures.traces_json(figures.band_traces(new.band, legend=False)))
        rates = Patch()
        rates["data"].extend(
            figures.traces_json(figures.rates_traces(new.tokens, new.mfu, legend=False))
        )
        next_state.update(last_step=int(new.band.step[-1]), segments=segments)
    if new.heatmap is not None and new.heatmap.values.size and new.band.step.size:
        grid = Patch()
        grid["data"].append(figures.traces_json([figures.heatmap_trace(new.heatmap)])[0])
        next_state["heatmap_from"] = int(new.heatmap.step_edges[-2])
    return (
        band,
        rates,
        grid,
        header_cards(s),
        ui.findings_list(job_id, new.findings),
        last_update_text(s),
        status_note(s),
        next_state,
        s.status != "running",
    )
