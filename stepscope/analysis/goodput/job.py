"""Goodput: where every GPU-second of a job went, across incarnations (docs/goodput.md).

The job's GPU-time is world size × wall time, from the first rank's process start to the
job's end (its last activity). Every second of it falls in one category of
schema.GOODPUT_CATEGORIES: productive, or a named badput. `unaccounted` is the remainder, so
the categories partition the total exactly.

Inputs are small: per step, sums over ranks (the step rollup: mean × ranks), and per rank and
process its lifecycle (stepscope.analysis.goodput.lifecycles). A step's row belongs to
the incarnation whose processes were running when it started; the store keeps the first row of
a (rank, step), so steps an incarnation ran again after a restart keep the earlier run's row,
and the later run's time on them is known only as a span (counted productive).

Every amount is placed in time as it is counted (stepscope.analysis.goodput.timeline), so the
answer (stepscope.analysis.goodput.result) also reads per window. A step's own split is
stepscope.analysis.goodput.steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from stepscope.analysis.goodput.lifecycles import Lifecycles, lifecycles, without_lifecycle
from stepscope.analysis.goodput.result import Goodput, Incarnation, empty_goodput, windows, within
from stepscope.analysis.goodput.steps import (
    GoodputConfig,
    ideal_step_s,
    job_steps,
    rank_steps,
    rerun_split,
    step_split,
)
from stepscope.analysis.goodput.timeline import Ledger, default_window_s
from stepscope.schema import GOODPUT_CATEGORIES

__all__ = [
    "Goodput",
    "GoodputConfig",
    "Incarnation",
    "Lifecycles",
    "default_window_s",
    "goodput",
    "hang_windows",
    "ideal_step_s",
    "job_steps",
    "lifecycles",
    "rank_steps",
    "windows",
    "within",
    "without_lifecycle",
]


def goodput(
    steps: pl.DataFrame,
    life: Lifecycles,
    *,
    world_size: int,
    ended_at: float | None = None,
    hangs: Sequence[tuple[float, float]] = (),
    config: GoodputConfig | None = None,
    ranks: Iterable[int] | None = None,
    ideal: tuple[float, float] | None = None,
) -> Goodput:
    """The job's goodput from its steps (STEP_COLUMNS of goodput_steps) and lifecycles.

    `hangs` are (stall ts, detection ts) of the job's hang findings. With `ranks`, only those
    ranks' GPU-time is accounted (`steps` then holds their sums alone) and `ideal` is the job's
    (ideal per-rank step time, typical job step time), so that a rank is judged by the job.
    """
    config = config or GoodputConfig()
    processes = life.processes
    if ranks is not None:
        wanted = list(ranks)
        processes = processes.filter(pl.col("rank").is_in(wanted))
        phases = life.phases.filter(pl.col("rank").is_in(wanted))
    else:
        phases = life.phases
    steps = steps.sort("ts")
    ts = steps["ts"].to_numpy().astype(np.float64)
    ends = ts + steps["step_s_max"].to_numpy().astype(np.float64)
    job_start = _start_of(processes, ts)
    last_activity = max(
        _nanmax(ends),
        _nanmax(processes["last_ts"].to_numpy()) if processes.height else -math.inf,
        _nanmax(processes["last_phase_end"].to_numpy()) if processes.height else -math.inf,
        max((d for _, d in hangs), default=-math.inf),
        ended_at if ended_at is not None else -math.inf,
    )
    if not math.isfinite(job_start) or not math.isfinite(last_activity):
        return empty_goodput(world_size)
    job_end = max(last_activity, job_start)
    num_lanes = world_size if ranks is None else processes["rank"].n_unique()
    total_s = num_lanes * (job_end - job_start)
    if ideal is None:
        ideal = ideal_step_s(steps)
    ideal_s = ideal[0]

    # Incarnation k of the job: every rank's k-th process; it starts with the first of them.
    by_index = processes.group_by("index").agg(pl.col("started_at").min()).sort("index")
    starts = by_index["started_at"].to_numpy().astype(np.float64)
    if starts.size == 0:
        starts = np.array([job_start])
    # A step belongs to the incarnation whose first step began before it: the resume events'
    # times are the steps' own clock, where process start times are only as precise as the
    # kernel's boot time (a second), which would hand a dying incarnation's last steps to the
    # next one.
    step_starts = starts
    if processes.height:
        first = processes.group_by("index").agg(pl.col("first_step_ts").min()).sort("index")
        first_ts = first["first_step_ts"].to_numpy().astype(np.float64)
        step_starts = np.maximum.accumulate(np.fmax(first_ts, starts))
    incarnation_of_step = np.maximum(np.searchsorted(step_starts, ts, side="right") - 1, 0)
    totals: dict[str, float] = dict.fromkeys(GOODPUT_CATEGORIES, 0.0)
    incarnations: list[Incarnation] = []
    first_starts = processes.filter(pl.col("index") == 0)["started_at"].to_numpy()
    ledger = Ledger()
    phase_cat = phases["category"].to_numpy().astype(str)
    phase_ts = phases["ts"].to_numpy().astype(np.float64)
    phase_dur = phases["duration_s"].to_numpy().astype(np.float64)
    phase_rank = phases["rank"].to_numpy()
    phase_inc = np.maximum(np.searchsorted(starts, phase_ts, side="right") - 1, 0)
    exceptions = life.exceptions.sort("ts")
    exc_ts = exceptions["ts"].to_numpy().astype(np.float64)
    # An exception belongs to its process's incarnation; by its time when it does not say
    # (process start times are only as precise as the kernel's boot time, a second).
    exc_inc = np.where(
        exceptions["index"].is_not_null().to_numpy(),
        exceptions["index"].fill_null(0).to_numpy(),
        np.maximum(np.searchsorted(starts, exc_ts, side="right") - 1, 0),
    )

    for k in range(starts.size):
        cats: dict[str, float] = dict.fromkeys(GOODPUT_CATEGORIES, 0.0)
        if k == 0:  # ranks waiting for their launch
            ledger.add(cats, "startup", first_starts - job_start, job_start, first_starts)
        procs = processes.filter(pl.col("index") == k)
        nxt = processes.filter(pl.col("index") == k + 1)
        is_last = k == starts.size - 1
        in_k = incarnation_of_step == k
        k_steps = steps.filter(pl.Series(in_k))
        k_ends = ends[in_k]
        last_end = _nanmax(k_ends)
        window_end = starts[k + 1] if not is_last else math.inf
        k_hangs = [(s, d) for s, d in hangs if starts[k] <= s < window_end]
        if is_last:
            end = job_end
        else:
            activity = [
                last_end,
                _nanmax(procs["exit_ts"].to_numpy()),
                _nanmax(procs["last_phase_end"].to_numpy()),
                _nanmax(exc_ts[exc_inc == k]),
                *(d for _, d in k_hangs),
            ]
            end = min(max(a for a in activity if math.isfinite(a)), window_end)
        resumed_at = _resume_step(nxt)
        interrupted = _min_int(exceptions.filter(pl.Series(exc_inc == k))["step"])
        # Per process: [start, first step) is startup; restart downtime follows the end.
        started = procs["started_at"].to_numpy().astype(np.float64)
        first_ts_of = procs["first_step_ts"].fill_null(np.nan).to_numpy().astype(np.float64)
        startup_end = np.minimum(np.where(np.isnan(first_ts_of), end, first_ts_of), end)
        ledger.add(cats, "startup", np.maximum(0.0, startup_end - started), started, startup_end)
        if not is_last:
            following = procs.select("rank").join(
                nxt.select("rank", pl.col("started_at").alias("restart_at")), on="rank", how="left"
            )
            restart_at = following["restart_at"].fill_null(end).to_numpy().astype(np.float64)
            downtime = np.maximum(0.0, restart_at - end)
            ledger.add(cats, "restart_downtime", downtime, end, restart_at)
        stepping = procs.filter(pl.col("first_step_ts").is_not_null())
        n_k = stepping.height
        first_ts_sum = float(stepping["first_step_ts"].sum()) if n_k else 0.0
        lost_steps: list[int] | None = None
        hang_detection_s: float | None = None
        last_end = last_end if math.isfinite(last_end) else end
        lost_start = last_end
        has_lost = False
        if k_steps.height and n_k:
            step_no = k_steps["step"].to_numpy()
            lost = step_no >= resumed_at if resumed_at is not None else np.zeros_like(step_no, bool)
            kept_steps = k_steps.filter(pl.Series(~lost))
            lost_start = float(np.min(k_steps["ts"].to_numpy()[lost])) if lost.any() else last_end
            has_lost = bool(lost.any())
            if has_lost:
                # The step an exception interrupted is lost, but was never run to its end.
                done = (
                    step_no[lost & (step_no < interrupted)]
                    if interrupted is not None
                    else step_no[lost]
                )
                if done.size:
                    lost_steps = [int(done.min()), int(done.max())]
                lost_s = n_k * max(0.0, last_end - lost_start)
                ledger.add(cats, "lost_progress", lost_s, lost_start, last_end)
            kept_ts = kept_steps["ts"].to_numpy().astype(np.float64)
            kept_end = kept_ts + kept_steps["step_s_max"].to_numpy().astype(np.float64)
            for c, v in step_split(kept_steps, ideal, k_hangs, config).items():
                ledger.add(cats, c, v, kept_ts, kept_end)
            # Steps run again whose rows the store holds from the earlier run: progress kept,
            # unless the next incarnation resumed before them (then lost, pro rata).
            first_stored = float(np.min(k_steps["ts"].to_numpy()))
            first_step = _min_int(stepping["first_step"])
            first_row_step = int(step_no.min())
            if first_step is not None and first_row_step > first_step:
                rerun_s = (
                    n_k * first_stored
                    - first_ts_sum
                    - _phases_between(phases, stepping, first_stored)
                )
                num_rerun = first_row_step - first_step
                num_lost = 0
                if resumed_at is not None:
                    num_lost = min(num_rerun, max(0, first_row_step - max(resumed_at, first_step)))
                rerun_from = float(stepping["first_step_ts"].min())  # type: ignore[arg-type]
                lost_s = max(0.0, rerun_s) * num_lost / num_rerun
                ledger.add(cats, "lost_progress", lost_s, rerun_from, first_stored)
                earlier = steps.filter(
                    pl.col("step").is_between(first_step, first_row_step - num_lost - 1)
                    & (pl.col("ts") < starts[k])
                )
                kept_s = rerun_s * (num_rerun - num_lost) / num_rerun
                for c, gpu_s in rerun_split(earlier, n_k, kept_s, ideal, config).items():
                    ledger.add(cats, c, gpu_s, rerun_from, first_stored)
            tail = n_k * max(0.0, end - last_end)
            if k_hangs:
                ledger.add(cats, "hang", tail, last_end, end)
                hang_detection_s = max(d - s for s, d in k_hangs)
            elif is_last:
                ledger.add(cats, "unaccounted", tail, last_end, end)
            else:  # the interrupted step
                ledger.add(cats, "lost_progress", tail, last_end, end)
        elif n_k:  # stepped on no stored row (all superseded or none yet)
            rerun_s = n_k * end - first_ts_sum - _phases_between(phases, stepping, end)
            earlier = steps.filter(pl.col("ts") < starts[k])
            rerun_from = float(stepping["first_step_ts"].min())  # type: ignore[arg-type]
            for c, gpu_s in rerun_split(earlier, n_k, rerun_s, ideal, config).items():
                ledger.add(cats, c, gpu_s, rerun_from, end)
        # Declared phases: their own category, out of the window they fell in.
        mine = phase_inc == k
        if mine.any():
            ts_i, dur_i = phase_ts[mine], phase_dur[mine]
            first_i = (
                pl.DataFrame({"rank": phase_rank[mine]})
                .join(stepping.select("rank", "first_step_ts"), on="rank", how="left")[
                    "first_step_ts"
                ]
                .fill_null(np.inf)
                .to_numpy()
                .astype(np.float64)
            )
            cat_i = phase_cat[mine]
            end_i = ts_i + dur_i
            for cat in np.unique(cat_i):
                at = cat_i == cat
                ledger.add(cats, str(cat), dur_i[at], ts_i[at], end_i[at])
            before = ts_i < first_i
            after = ~before & (ts_i >= last_end)
            in_lost = ~before & ~after & has_lost & (ts_i >= lost_start)
            window = "hang" if k_hangs else "unaccounted" if is_last else "lost_progress"
            for c, at in (("startup", before), (window, after), ("lost_progress", in_lost)):
                ledger.add(cats, c, -dur_i[at], ts_i[at], end_i[at])
            # The others: the rerun span left them out already, or the kept span's gaps
            # (the unaccounted remainder) hold them.
        span = float(np.sum(np.maximum(0.0, min(end, job_end) - started)))
        if not is_last:
            span += cats["restart_downtime"]
        if k == 0:
            span += float(np.sum(first_starts - job_start))
        cats["unaccounted"] += span - sum(v for c, v in cats.items() if c != "unaccounted")
        for c in GOODPUT_CATEGORIES:
            totals[c] += cats[c]
        failure = None
        k_exc = exceptions.filter(pl.Series(exc_inc == k))
        if k_exc.height:
            failure = k_exc.drop("index").row(0, named=True)
        incarnations.append(
            Incarnation(
                index=k,
                started_at=float(starts[k]),
                ended_at=float(end),
                num_ranks=procs.height,
                first_step=_min_int(stepping["first_step"]) if n_k else None,
                last_step=int(k_steps["step"].max()) if k_steps.height else None,  # type: ignore[arg-type]
                resumed_at=resumed_at,
                lost_steps=lost_steps,
                interrupted_step=interrupted,
                categories=cats,
                failure=failure,
                hang_detection_s=hang_detection_s,
            )
        )
    totals["unaccounted"] = total_s - sum(v for c, v in totals.items() if c != "unaccounted")
    productive = totals["productive"]
    kept_step_s = productive + sum(totals[c] for c in ("data", "exposed_comm", "straggler_wait"))
    submitted = _nanmin(processes["submitted_at"].to_numpy()) if processes.height else math.nan
    scheduling = (
        (job_end - job_start) / (job_end - submitted)
        if math.isfinite(submitted) and submitted < job_start
        else None
    )
    runtime = kept_step_s / total_s if total_s > 0 else None
    program = productive / kept_step_s if kept_step_s > 0 else None
    product = None
    if runtime is not None and program is not None:
        product = runtime * program * (scheduling if scheduling is not None else 1.0)
    return Goodput(
        world_size=num_lanes,
        started_at=job_start,
        ended_at=job_end,
        total_s=total_s,
        categories=totals,
        goodput=productive / total_s if total_s > 0 else 0.0,
        ideal_step_s=ideal_s if math.isfinite(ideal_s) else None,
        layers={
            "scheduling": scheduling,
            "runtime": runtime,
            "program": program,
            "product": product,
        },
        incarnations=incarnations,
        ledger=ledger,
    )


def _phases_between(phases: pl.DataFrame, stepping: pl.DataFrame, until: float) -> float:
    """Seconds of declared phases from each rank's first step to `until`."""
    joined = phases.join(stepping.select("rank", "first_step_ts"), on="rank")
    inside = joined.filter((pl.col("ts") >= pl.col("first_step_ts")) & (pl.col("ts") < until))
    return float(inside["duration_s"].sum())


def _resume_step(nxt: pl.DataFrame) -> int | None:
    """The step the next incarnation resumed at: declared, else its first step."""
    if nxt.height == 0:
        return None
    declared = _min_int(nxt["resumed_from"])
    return declared if declared is not None else _min_int(nxt["first_step"])


def _start_of(processes: pl.DataFrame, ts: np.ndarray[Any, Any]) -> float:
    if processes.height:
        return float(processes["started_at"].min())  # type: ignore[arg-type]
    return _nanmin(ts)


def _min_int(series: pl.Series) -> int | None:
    value = series.drop_nulls().min()
    return None if value is None else int(value)  # type: ignore[arg-type]


def _nanmax(x: Any) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(x.max()) if x.size else -math.inf


def _nanmin(x: Any) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(x.min()) if x.size else math.inf


def hang_windows(findings: Iterable[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """(stall ts, detection ts) of a job's hang findings."""
    out = []
    for f in findings:
        if f.get("kind") != "hang":
            continue
        evidence = f.get("evidence") or {}
        since = evidence.get("since_ts")
        detected = f.get("detected_at")
        if since is None:
            continue
        if detected is None:
            detected = since + float(evidence.get("detection_s") or 0.0)
        out.append((float(since), float(detected)))
    return out
