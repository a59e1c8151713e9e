"""Generated job timelines with known goodput: restarts of both kinds, hangs, stalls,
checkpoints, evaluation, compilation, data stalls and slow ranks, with the truth of every
category and what stepscope would have stored (docs/goodput.md, benchmarks/goodput_accuracy.py).

Each step, every rank fetches data and computes (its ready time), then all wait at the
gradient all-reduce for the last to arrive, plus the transfer. The truth is kept as it
happens: a stall is hang for every rank, the waiting for a late rank is straggler wait, the
extra compute of the first steps is compilation, and the steps a restart runs again are lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import polars as pl

from stepscope.schema import GOODPUT_CATEGORIES


@dataclass(kw_only=True, slots=True)
class Failure:
    """A failure during step `at_step` of the run."""

    at_step: int
    kind: Literal["crash", "hang"] = "crash"
    resume: Literal["checkpoint", "next"] = "checkpoint"
    """Resume from the last checkpoint, or at the failed step (no progress lost)."""
    downtime_s: float = 300.0
    """From the failure (the hang's abort) to the next processes' start."""
    detect_s: float = 60.0
    """A hang: from the stall to its detection."""
    abort_s: float = 10.0
    """A hang: from its detection to the abort."""
    at_fraction: float = 0.5
    """A crash: how far into the step it happens (0: between steps, before it began)."""
    rank: int = 0


@dataclass(kw_only=True, slots=True)
class Scenario:
    world_size: int = 8
    num_steps: int = 200
    step_s: float = 1.0
    noise: float = 0.02
    transfer_s: float = 0.05
    data_s: float = 0.01
    startup_s: float = 30.0
    launch_jitter_s: float = 2.0
    load_s: float = 5.0
    """checkpoint_load phase before the first step of a resumed incarnation (at most half of
    startup_s)."""
    compile_steps: int = 2
    compile_factor: float = 5.0
    ckpt_every: int = 50
    ckpt_s: float = 8.0
    eval_every: int = 0
    eval_s: float = 20.0
    failures: list[Failure] = field(default_factory=list)
    stall: tuple[int, float] | None = None
    """(step, seconds): one rank stalls inside that step, which then completes."""
    slow: tuple[list[int], int, int, float] | None = None
    """(ranks, first step, last step, factor): these ranks compute slower."""
    data_stall: tuple[list[int], float] | None = None
    """(ranks, seconds): these ranks wait this long for every batch."""
    declare_resume: bool = True
    submitted_before_s: float | None = 120.0
    seed: int = 0
    rank_rows: bool = False
    """Keep every rank's step rows (Timeline.rank_rows) as the store would: small jobs only."""


@dataclass(kw_only=True, slots=True)
class Timeline:
    """A generated job: the truth, and what the store would hold."""

    world_size: int
    truth: dict[str, float]
    """GPU-seconds per category."""
    started_at: float
    ended_at: float
    steps: pl.DataFrame
    """Per step, the job's sums over ranks (stepscope.analysis.goodput.steps.STEP_COLUMNS)."""
    events: pl.DataFrame
    """rank, ts, kind, message, attributes (JSON text)."""
    hangs: list[tuple[float, float]]
    rank0_step_starts: list[tuple[int, float]]
    """(step, start) of every step rank 0 began, in time order, repeats included: what
    ml-goodput-measurement's single writer records."""
    rank0_job_starts: list[float]
    lost_steps: list[list[int]]
    rank_rows: pl.DataFrame | None = None
    """rank, step, ts, step_s, data_s, comm_wait_s: every rank's stored rows (on request)."""

    @property
    def total_s(self) -> float:
        return self.world_size * (self.ended_at - self.started_at)


def generate(s: Scenario) -> Timeline:
    """Simulate the scenario's job; return its truth and its stored form."""
    rng = np.random.default_rng(s.seed)
    w = s.world_size
    ranks = np.arange(w)
    truth: dict[str, float] = dict.fromkeys(GOODPUT_CATEGORIES, 0.0)
    rows: dict[int, tuple[float, ...]] = {}
    per_rank: list[tuple[int, int, float, float, float, float]] = []
    events: list[tuple[int, float, str, str | None, str]] = []
    hangs: list[tuple[float, float]] = []
    rank0_steps: list[tuple[int, float]] = []
    rank0_job_starts: list[float] = []
    lost_steps: list[list[int]] = []
    failures = {f.at_step: f for f in s.failures}
    t0 = 1.7e9
    t = t0
    step = 0
    last_ckpt = 0
    incarnation = 0
    failed_at = t0
    while True:
        # A new incarnation: processes start, initialise, (load), then step.
        starts = t + rng.uniform(0.0, s.launch_jitter_s, w)
        if incarnation == 0:
            starts -= starts.min() - t0  # the job starts with its first process
        if incarnation == 0:
            truth["startup"] += float(np.sum(starts - t0))
        else:
            truth["restart_downtime"] += float(np.sum(starts - failed_at))
        rank0_job_starts.append(float(starts[0]))
        inc_ids = [f"{incarnation}-{r}" for r in ranks]
        for r in ranks:
            attrs = {"incarnation": inc_ids[r], "restart_count": incarnation}
            if s.submitted_before_s is not None:
                attrs["submitted_at"] = t0 - s.submitted_before_s
            events.append((int(r), float(starts[r]), "start", None, json.dumps(attrs)))
        first_ts = float(starts.max()) + s.startup_s
        truth["startup"] += float(np.sum(first_ts - starts))
        if incarnation > 0 and s.load_s > 0:
            load_s = min(s.load_s, s.startup_s / 2)  # inside the initialisation
            truth["startup"] -= w * load_s
            truth["checkpoint_load"] += w * load_s
            _phase(events, ranks, inc_ids, first_ts - load_s, "checkpoint_load", load_s)
        resumed_from = step
        for r in ranks:
            attrs = {"incarnation": inc_ids[r], "step": step}
            if s.declare_resume and incarnation > 0:
                attrs["resumed_from"] = resumed_from
            events.append((int(r), first_ts, "resume", None, json.dumps(attrs)))
        t = first_ts
        first_of_inc = step
        # Per step of this incarnation: its truth, to move to lost progress on a rollback.
        ledger: list[tuple[int, dict[str, float]]] = []
        failed: Failure | None = None
        while step < s.num_steps:
            if step != first_of_inc and s.ckpt_every and step % s.ckpt_every == 0:
                truth["checkpoint_save"] += w * s.ckpt_s
                _phase(events, ranks, inc_ids, t, "checkpoint_save", s.ckpt_s)
                t += s.ckpt_s
                last_ckpt = step
            if step != first_of_inc and s.eval_every and step % s.eval_every == 0:
                truth["eval"] += w * s.eval_s
                _phase(events, ranks, inc_ids, t, "eval", s.eval_s)
                t += s.eval_s
            failure = failures.pop(step, None)
            if failure is None or failure.kind == "hang" or failure.at_fraction > 0:
                rank0_steps.append((step, t))  # a crash at fraction 0 comes before the step
            normal = s.step_s * (1.0 + s.noise * rng.standard_normal(w))
            compute = normal.copy()
            if s.slow is not None and s.slow[1] <= step <= s.slow[2]:
                compute[s.slow[0]] *= s.slow[3]
                normal = compute.copy()
            if step - first_of_inc < s.compile_steps:
                compute = compute * s.compile_factor
            data = np.full(w, s.data_s)
            if s.data_stall is not None:
                data[s.data_stall[0]] += s.data_stall[1]
            ready = data + compute
            max_ready = float(ready.max())
            if failure is not None:
                failed = failure
                if failure.kind == "crash":
                    crash_at = t + failure.at_fraction * (max_ready + s.transfer_s)
                    truth["lost_progress"] += w * (crash_at - t)
                    events.append(
                        (failure.rank, crash_at, "exception", "RuntimeError: injected", "{}")
                    )
                    t = crash_at
                else:
                    detected = t + failure.detect_s
                    abort = detected + failure.abort_s
                    hangs.append((t, detected))
                    truth["hang"] += w * (abort - t)
                    step_doc = json.dumps({"step": step})
                    events.append((failure.rank, abort, "exception", "hang: aborted", step_doc))
                    t = abort
                break
            stall_s = s.stall[1] if s.stall is not None and s.stall[0] == step else 0.0
            step_s = max_ready + stall_s + s.transfer_s
            wait = step_s - ready  # everyone waits for the last, then the transfer
            if stall_s:
                wait[int(np.argmax(ready))] -= stall_s  # the stalled rank computes, not waits
            part = {
                "data": float(data.sum()),
                "exposed_comm": w * s.transfer_s,
                "straggler_wait": float(np.sum(max_ready - ready)),
                "productive": float(normal.sum()),
                "compile": float(np.sum(compute - normal)),
                "hang": w * stall_s,
            }
            ledger.append((step, part))
            for c, v in part.items():
                truth[c] += v
            if step not in rows:  # the store keeps a (rank, step)'s first row
                comm_wait = wait
                if s.rank_rows:
                    per_rank += [
                        (int(r), step, t, step_s, float(data[r]), float(comm_wait[r]))
                        for r in ranks
                    ]
                rows[step] = (
                    t,
                    w,
                    w * step_s,
                    step_s,
                    float(data.sum()),
                    float(comm_wait.sum()),
                    w * float(comm_wait.min()),
                )
            t += step_s
            step += 1
        if failed is None:
            break
        resume = failed.at_step if failed.resume == "next" else last_ckpt
        for st, part in ledger:
            if st >= resume:
                for c, v in part.items():
                    truth[c] -= v
                    truth["lost_progress"] += v
        if resume < failed.at_step:
            lost_steps.append([resume, failed.at_step - 1])
        failed_at = t
        t += failed.downtime_s
        step = resume
        incarnation += 1
    ended_at = t
    for r in ranks:
        events.append(
            (int(r), ended_at, "exit", None, json.dumps({"incarnation": f"{incarnation}-{r}"}))
        )
    steps = pl.DataFrame(
        [(st, *v) for st, v in sorted(rows.items())],
        schema=[
            ("step", pl.Int64),
            ("ts", pl.Float64),
            ("num_ranks", pl.Int64),
            ("step_s_sum", pl.Float64),
            ("step_s_max", pl.Float64),
            ("data_s_sum", pl.Float64),
            ("comm_wait_s_sum", pl.Float64),
            ("transfer_s_sum", pl.Float64),
        ],
        orient="row",
    )
    return Timeline(
        world_size=w,
        truth=truth,
        started_at=t0,
        ended_at=ended_at,
        steps=steps,
        events=pl.DataFrame(
            events,
            schema=[
                ("rank", pl.Int64),
                ("ts", pl.Float64),
                ("kind", pl.String),
                ("message", pl.String),
                ("attributes", pl.String),
            ],
            orient="row",
        ),
        hangs=hangs,
        rank0_step_starts=rank0_steps,
        rank0_job_starts=rank0_job_starts,
        lost_steps=lost_steps,
        rank_rows=pl.DataFrame(
            per_rank,
            schema=["rank", "step", "ts", "step_s", "data_s", "comm_wait_s"],
            orient="row",
        )
        if s.rank_rows
        else None,
    )


def _phase(
    events: list[tuple[int, float, str, str | None, str]],
    ranks: np.ndarray,
    incarnations: list[str],
    ts: float,
    name: str,
    duration_s: float,
) -> None:
    for r in ranks:
        attrs = {"incarnation": incarnations[r], "name": name, "duration_s": duration_s}
        events.append((int(r), ts, "phase", None, json.dumps(attrs)))
