"""A job's goodput (docs/goodput.md): from its step rollups, lifecycle events and findings."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl
import sqlalchemy as sa

from stepscope.analysis.goodput import job as gp
from stepscope.analysis.goodput.lifecycles import Lifecycles
from stepscope.query.common import require_job
from stepscope.query.memo import per_pass
from stepscope.store import frames, reads, tables

LIFECYCLE_KINDS = ("start", "resume", "phase", "exit", "exception")
_ROLLUP_COLUMNS = (
    "step",
    "ts",
    "num_ranks",
    "step_s_mean",
    "step_s_max",
    "data_s_mean",
    "comm_wait_s_mean",
    "comm_wait_s_min",
)
MAX_WINDOWS = 10_000
"""Most windows a goodput answer holds."""
_RESPONSIBLE_KINDS = {
    "straggler_wait": ("straggler_rank", "straggler_node"),
    "data": ("dataloader_stall",),
    "hang": ("hang",),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class JobGoodput:
    """A job's goodput, with who is responsible for its largest badput where known."""

    job_id: str
    result: gp.Goodput
    responsible: dict[str, list[dict[str, Any]]]
    """Category → the ranks (or node) and cause behind it: the stragglers, the hang's
    culprits, the ranks whose exception ended an incarnation."""
    ranks: dict[int, gp.Goodput] | None
    """Per rank (on request)."""
    window_s: float | None = None
    """The length of the windows (None when the job has no GPU-time yet)."""
    windows: pl.DataFrame | None = None
    """Per window: start, end, gpu_s and every category's GPU-seconds (gp.windows)."""


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What a job's goodput is computed from."""

    job: dict[str, Any]
    steps: pl.DataFrame
    life: Lifecycles
    world_size: int
    hangs: list[tuple[float, float]]

    @classmethod
    def of(
        cls,
        engine: sa.Engine,
        job: dict[str, Any],
        rollup: pl.DataFrame,
        stored_findings: Iterable[Mapping[str, Any]],
    ) -> _Inputs:
        steps = gp.job_steps(rollup)
        events = reads.read_events_of_kinds(engine, job["job_id"], LIFECYCLE_KINDS)
        life = gp.lifecycles(events)
        world_size = int(job.get("world_size") or max(1, life.processes["rank"].n_unique()))
        if life.processes.height == 0:
            life = gp.without_lifecycle(steps, world_size)
        return cls(job, steps, life, world_size, gp.hang_windows(stored_findings))

    def whole_job(self) -> gp.Goodput:
        return gp.goodput(
            self.steps,
            self.life,
            world_size=self.world_size,
            ended_at=self.job.get("ended_at"),
            hangs=self.hangs,
        )


def goodput_share(
    engine: sa.Engine,
    job: dict[str, Any],
    rollup: pl.DataFrame,
    stored_findings: Iterable[Mapping[str, Any]],
) -> float | None:
    """The job's goodput (productive share of its GPU-time) from its step rollup (at least
    the columns job_goodput reads) and findings; None before it has GPU-time. What each
    analysis pass stores in the job's summary."""
    result = _Inputs.of(engine, job, rollup, stored_findings).whole_job()
    return result.goodput if result.total_s > 0 else None


@per_pass
def job_goodput(
    engine: sa.Engine,
    job_id: str,
    *,
    per_rank: bool = False,
    window_s: float | None = None,
    with_windows: bool = True,
) -> JobGoodput:
    """The job's goodput; `per_rank` adds every rank's (reads the raw step rows), and its
    windows of `window_s` seconds (default: gp.default_window_s of the job's span). Computed
    once per analyzer pass of the job (stepscope.query.memo), like its other rollup answers."""
    job = require_job(engine, job_id)
    rollup = reads.read_rollup(engine, tables.step_rollups, job_id, columns=_ROLLUP_COLUMNS)
    stored_findings = reads.read_findings(engine, job_id)
    inputs = _Inputs.of(engine, job, rollup, stored_findings)
    result, life, hangs = inputs.whole_job(), inputs.life, inputs.hangs
    ranks = None
    if per_rank:
        columns = ["rank", "step", "ts", "step_s", "data_s", "comm_wait_s"]
        raw = frames.read_frame(engine, "steps", job_id, columns=columns)
        by_rank = gp.rank_steps(raw)
        ideal = gp.ideal_step_s(inputs.steps)
        ranks = {}
        for rank in sorted(set(life.processes["rank"].to_list())):
            ranks[int(rank)] = gp.goodput(
                by_rank.filter(pl.col("rank") == rank),
                life,
                world_size=1,
                ended_at=result.ended_at if math.isfinite(result.ended_at) else None,
                hangs=hangs,
                ranks=[rank],
                ideal=ideal,
            )
    span_s = result.ended_at - result.started_at
    windows = None
    if with_windows and math.isfinite(span_s) and span_s > 0:
        window_s = window_s or gp.default_window_s(span_s)
        if span_s / window_s > MAX_WINDOWS:
            raise ValueError(
                f"window_s: {window_s:g} s cuts the job's {span_s:.0f} s in more than "
                f"{MAX_WINDOWS:,} windows; give at least {span_s / MAX_WINDOWS:.3g} s"
            )
        windows = gp.windows(result, window_s)
    return JobGoodput(
        job_id=job_id,
        result=result,
        responsible=_responsible(stored_findings, result),
        ranks=ranks,
        window_s=window_s if windows is not None else None,
        windows=windows,
    )


def _responsible(
    findings: list[dict[str, Any]], result: gp.Goodput
) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for category, kinds in _RESPONSIBLE_KINDS.items():
        for f in findings:
            if f["kind"] in kinds:
                out.setdefault(category, []).append(
                    {"ranks": f.get("ranks") or [], "node": f.get("node"), "cause": f.get("cause")}
                )
    for inc in result.incarnations:
        if inc.failure is not None:
            entry = {"ranks": [inc.failure["rank"]], "message": inc.failure["message"]}
            entry["incarnation"] = inc.index
            for category in ("lost_progress", "restart_downtime"):
                out.setdefault(category, []).append(entry)
    return out
