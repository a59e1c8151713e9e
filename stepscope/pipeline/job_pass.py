"""Incremental analysis of stored jobs: rollups and findings kept current from a watermark.

A pass reads only the job's batches received since its stored watermark (DESIGN §6): it
recomputes the rollups of the steps (and GPU time buckets) those batches touched, re-analyses
the step segments that read those steps (stepscope.analysis.stragglers.segments), runs the job-level
detectors on the step and collective rollups. It computes first, then stores rollups, state
and watermark, findings and summary in one transaction: a pass that fails stores nothing, and
the next one redoes its work. Findings stitched from many passes equal those of one full pass
over the same rows (both call stepscope.analysis.job's segment and stitch steps).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import polars as pl
import sqlalchemy as sa

from stepscope import schema
from stepscope.analysis import NUMERIC_STEP_COLUMNS, AnalysisConfig, job_findings
from stepscope.analysis import rollups as compute
from stepscope.analysis.job import SegmentRows, combined_findings, segment_findings
from stepscope.analysis.stragglers.segments import SegmentPlan
from stepscope.analysis.stragglers.telemetry import GPU_COLUMNS
from stepscope.pipeline.gpu_buckets import update_gpu_buckets
from stepscope.pipeline.node_levels import update_node_levels
from stepscope.pipeline.recent_rows import RecentRows
from stepscope.pipeline.resources import PassResources
from stepscope.pipeline.state import AnalysisState, Write, widen
from stepscope.query.goodput import goodput_share
from stepscope.store import analysis_state, findings, frames, jobs, rollup_tables, tables
from stepscope.store.job_locks import job_lock

log = logging.getLogger(__name__)

OVERLAP_S = 5.0
"""Batches received this long before the watermark are read again: a batch's received_at is
stamped when its transaction starts, so one may commit after a later-stamped one was read."""

_COLLECTIVE_COLUMNS = (
    *("rank", "step", "group", "op", "group_size", "count", "bytes", "busy_s"),
    *("first_seq", "mesh_dim", "group_ranks"),
)
"""Per group too: the rollups' labels, and who waited for whom
(stepscope.analysis.communication.groups)."""
_ROLLUP_COLUMNS = [c.name for c in tables.step_rollups.c if c.name != "job_id"]
_OP_COLUMNS = ["step", "group", "op", "group_size", "count", "bytes", "busy_s_min"]
"""What the job-level detectors read of the rollups."""
_SEGMENTS_PER_READ = 8
"""Segments analysed from one read of raw rows (bounds the memory of a full pass)."""


FindingsHook = Callable[[str, list[schema.Finding]], None]
"""Called after a pass stored a job's findings, with all of them (the webhook sender keeps
the warning and critical ones, the OTLP exporter all): it must return at once; an error in
it is logged, never raised."""


class RawRowsPrunedError(RuntimeError):
    """A full re-analysis of a job whose raw rows `stepscope db prune` deleted."""


class JobBusyError(RuntimeError):
    """Another pass over the job (another thread, or another server replica) kept it."""


LOCK_WAIT_S = 60.0
"""How long an on-demand pass waits for the job's pass that is running elsewhere."""


@dataclass(kw_only=True, slots=True)
class PassResult:
    """What one pass did."""

    rolled_up_steps: int = 0
    analysed_segments: list[int] = field(default_factory=list)
    findings: list[schema.Finding] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class _StepsDone:
    """What rolling up a pass's steps and re-analysing their segments left."""

    rolled_up_steps: int
    pending_from: int | None
    """First step held back: not every rank has reported it yet."""
    tail: RecentRows | None
    """The rows the next pass reads again, if this pass read them all."""


def _merged(older: pl.DataFrame, newer: pl.DataFrame) -> pl.DataFrame:
    """Rows of earlier and of later steps, each ordered by (rank, step, ...), in that order."""
    key = (pl.col("rank") * (1 << 32) + pl.col("step")).alias("_rank_step")
    return (
        older.with_columns(key)
        .merge_sorted(newer.with_columns(key), "_rank_step")
        .drop("_rank_step")
    )


class JobAnalyzer:
    """Runs incremental passes over one job of a store; each pass is one transaction."""

    def __init__(
        self,
        engine: sa.Engine,
        job_id: str,
        *,
        config: AnalysisConfig | None = None,
        grace_s: float = 30.0,
        on_findings: FindingsHook | None = None,
        resources: PassResources | None = None,
    ) -> None:
        self.engine = engine
        self.job_id = job_id
        self.config = config or AnalysisConfig()
        self.grace_s = grace_s
        self.on_findings = on_findings
        self._owned = PassResources() if resources is None else None
        self.resources = resources or self._owned
        """Shared with the owner's other passes, or this analyzer's own (see `close`)."""

    def close(self) -> None:
        """Release the resources this analyzer made for itself (none if it was given them)."""
        if self._owned is not None:
            self._owned.close()

    def __enter__(self) -> JobAnalyzer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def run(self, *, full: bool = False) -> PassResult:
        """One pass: from the stored watermark, or from scratch with `full`.

        The pass reads and computes first, then writes its rollups, state and watermark,
        findings and summary in one transaction: a pass that fails leaves the store as it
        was, and the next pass redoes its work.
        """
        assert self.resources is not None
        loaded = analysis_state.load_state(self.engine, self.job_id)
        writes: list[Write] = []
        if full:
            if loaded is not None and loaded[1].get("raw_pruned_before") is not None:
                raise RawRowsPrunedError(
                    f"the raw rows of job {self.job_id} were pruned: a full re-analysis would "
                    "lose its rollups and findings"
                )
            writes.append(partial(rollup_tables.delete_job_rollups, job_id=self.job_id))
            loaded = None
        state = AnalysisState() if loaded is None else AnalysisState.from_doc(loaded[1])
        watermark = -math.inf if loaded is None else loaded[0]
        database = self.engine.url.render_as_string()
        recent = None
        if loaded is not None:
            recent = self.resources.recent.take(database, self.job_id, watermark)
        arrivals = analysis_state.arrivals_since(self.engine, self.job_id, watermark)
        late = analysis_state.count_batches(
            self.engine, self.job_id, watermark - OVERLAP_S, watermark
        )
        if late > state.overlap_batches:  # committed after the last pass read past them
            arrivals = analysis_state.arrivals_since(
                self.engine, self.job_id, watermark - OVERLAP_S
            )
        result = PassResult()
        if arrivals is None and state.pending_from is None:
            return result
        job = jobs.load_job(self.engine, self.job_id) or {"job_id": self.job_id}
        now = time.time()
        tail: RecentRows | None = None

        lo, hi = state.pending_from, None
        if arrivals is not None:
            lo, hi = widen(lo, hi, arrivals.first_step, arrivals.last_step)
        state.first_step, state.last_step = widen(state.first_step, state.last_step, lo, hi)
        # GPU time buckets are made beside the steps' rollups and segments (they share no
        # state or table): each part waits mostly on its reads.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepscope-gpu") as gpu_pool:
            gpu = None
            if arrivals is not None and arrivals.first_gpu_ts is not None:
                gpu = gpu_pool.submit(
                    update_gpu_buckets,
                    self.engine,
                    self.job_id,
                    state,
                    arrivals.first_gpu_ts,
                    arrivals.last_gpu_ts,
                    stored=loaded is not None,
                )
            if lo is not None and state.first_step is not None and state.last_step is not None:
                if state.plan is None:
                    ranks = jobs.rank_nodes(self.engine, self.job_id)[1]
                    num_ranks = int(job.get("world_size") or len(ranks))
                    state.plan = SegmentPlan.of(state.first_step, num_ranks, self.config)
                writes += self._rebucket_steps(state, stored=loaded is not None)
                done = self._steps(
                    state,
                    job,
                    lo,
                    hi if hi is not None else state.last_step,
                    now,
                    result,
                    recent,
                    writes,
                )
                result.rolled_up_steps, state.pending_from = done.rolled_up_steps, done.pending_from
                tail = done.tail
            if gpu is not None:
                writes += gpu.result()

        if arrivals is not None:
            watermark = arrivals.received_at
        with self.engine.begin() as conn:
            for write in writes:
                write(conn)
            # The job-level detectors read the whole job's rollups, as this transaction left them.
            rollup = rollup_tables.read_step_rows(
                conn, tables.step_rollups, self.job_id, _ROLLUP_COLUMNS
            )
            found: list[schema.Finding] = []
            if state.plan is not None:
                per_segment = {
                    k: [schema.Finding(**f) for f in kept] for k, kept in state.segments.items()
                }
                job_level = self._job_findings(conn, state.plan, job, rollup)
                found = combined_findings(job_level, state.plan, per_segment, self.config)
            # A batch stamped within OVERLAP_S before the new watermark may still be
            # committing: the next pass re-reads that stretch if it then holds more batches.
            state.overlap_batches = analysis_state.count_batches(
                conn, self.job_id, watermark - OVERLAP_S, watermark
            )
            analysis_state.save_state(conn, self.job_id, watermark, state.to_doc(), now)
            findings.replace_findings(conn, self.job_id, found)
            if result.rolled_up_steps > 0:
                update_node_levels(self.engine, conn, self.job_id, job, now)
            result.findings = findings.load_findings(conn, self.job_id)
            if not rollup.is_empty() and state.plan is not None:
                summary = compute.steady_summary(rollup, state.plan.base_step)
                stored = [asdict(f) for f in result.findings]
                summary["goodput"] = goodput_share(self.engine, job, rollup, stored)
                severities = Counter(str(f.severity) for f in result.findings)
                analysis_state.save_summary(conn, self.job_id, summary, severities, now)
        if tail is not None:
            self.resources.recent.put(database, self.job_id, replace(tail, watermark=watermark))
        self._notify(result.findings)
        return result

    def _notify(self, findings: list[schema.Finding]) -> None:
        if self.on_findings is None:
            return
        try:
            self.on_findings(self.job_id, findings)
        except Exception:
            log.exception("the findings hook failed for job %s", self.job_id)

    # --- steps and collectives: rollups and segments -------------------------------------

    def _steps(
        self,
        state: AnalysisState,
        job: dict[str, Any],
        lo: int,
        hi: int,
        now: float,
        result: PassResult,
        recent: RecentRows | None,
        writes: list[Write],
    ) -> _StepsDone:
        """Roll up steps lo..hi (their rollups added to `writes`) and re-analyse the segments
        reading them (into `state`)."""
        plan = state.plan
        assert plan is not None
        assert state.last_step is not None
        touched = [k for k in plan.touched(lo, hi) if plan.start(k) <= state.last_step]
        groups = [
            touched[i : i + _SEGMENTS_PER_READ] for i in range(0, len(touched), _SEGMENTS_PER_READ)
        ] or [[]]
        b = state.bucket_steps
        rolled_up, pending = 0, None
        nodes, ranks = jobs.rank_nodes(self.engine, self.job_id)
        meshes = jobs.rank_meshes(self.engine, self.job_id)
        for i, group in enumerate(groups):
            # This read's share of the dirty steps (the first also takes the warm-up's), and
            # what it must read: those steps' whole rank buckets and its segments' spans.
            own_lo = lo if i == 0 else max(lo, plan.start(group[0]))
            own_hi = hi if i == len(groups) - 1 else min(hi, plan.start(group[-1] + 1) - 1)
            read_lo, read_hi = own_lo - own_lo % b, own_hi - own_hi % b + b - 1
            if group:
                read_lo, read_hi = widen(
                    read_lo, read_hi, plan.span(group[0])[0], plan.span(group[-1])[1]
                )
            steps, collectives = self._read_rows(read_lo, read_hi, lo, sorted(ranks), recent)
            if own_lo <= own_hi:
                n, held = self._roll_up(state, job, steps, collectives, own_lo, own_hi, now, writes)
                rolled_up += n
                if held is not None:
                    pending = held if pending is None else min(pending, held)
            for k in group:
                in_span = pl.col("step").is_between(*plan.span(k))
                span_steps = steps.filter(in_span)
                found = []
                if not span_steps.is_empty():
                    found = segment_findings(
                        self.job_id,
                        plan,
                        k,
                        SegmentRows.of(span_steps, collectives.filter(in_span)),
                        self._gpu_source(span_steps),
                        nodes=nodes,
                        meshes=meshes,
                        config=self.config,
                    )
                state.segments[k] = [f.to_dict() for f in found]
                result.analysed_segments.append(k)
        # The next pass re-reads the last segment's span and the last step's rank bucket.
        last = state.last_step
        keep_from = max(read_lo, min(plan.span(plan.index(last))[0], last - last % b))
        done = _StepsDone(rolled_up_steps=rolled_up, pending_from=pending, tail=None)
        if read_hi < last or keep_from > read_hi:
            return done
        kept = pl.col("step") >= keep_from
        done.tail = RecentRows(
            watermark=math.nan,
            first_step=keep_from,
            last_step=read_hi,
            steps=steps.filter(kept),
            collectives=collectives.filter(kept),
        )
        return done

    def _read_rows(
        self, lo: int, hi: int, dirty_from: int, ranks: list[int], recent: RecentRows | None
    ) -> tuple[pl.DataFrame, pl.DataFrame]:
        """Step and collective rows of steps lo..hi: those before `dirty_from` (which no new
        batch touched) from `recent` where it holds them, the others from the database."""
        cached_to = lo - 1
        if recent is not None and recent.first_step <= lo:
            cached_to = min(dirty_from - 1, recent.last_step, hi)
        # With the ranks listed, the (job_id, rank, step) key serves the step range. The two
        # reads run at once: each waits mostly on the database (or the SQLite reader process).
        assert self.resources is not None
        read = list(
            self.resources.reads.map(
                lambda table_columns: frames.read_frame(
                    self.engine,
                    table_columns[0],
                    self.job_id,
                    columns=table_columns[1],
                    from_step=max(lo, cached_to + 1),
                    to_step=hi,
                    ranks=ranks,
                ),
                (("steps", NUMERIC_STEP_COLUMNS), ("collectives", _COLLECTIVE_COLUMNS)),
            )
        )
        if recent is None or cached_to < lo:
            return read[0], read[1]
        cached = pl.col("step").is_between(lo, cached_to)
        steps, collectives = (
            _merged(kept.filter(cached), fresh)
            for kept, fresh in ((recent.steps, read[0]), (recent.collectives, read[1]))
        )
        return steps, collectives

    def _roll_up(
        self,
        state: AnalysisState,
        job: dict[str, Any],
        steps: pl.DataFrame,
        collectives: pl.DataFrame,
        lo: int,
        hi: int,
        now: float,
        writes: list[Write],
    ) -> tuple[int, int | None]:
        """Rollups of steps lo..hi from their raw rows, added to `writes`; (steps rolled up,
        first step held back)."""
        dirty = steps.filter(pl.col("step").is_between(lo, hi))
        if dirty.is_empty():
            return 0, None
        rollup = compute.step_rollup(
            dirty, peak_flops=job.get("peak_flops"), world_size=job.get("world_size")
        )
        ends = dirty.group_by("step").agg((pl.col("ts") + pl.col("step_s")).max().alias("end"))
        rollup = rollup.join(ends, on="step")
        expected = job.get("world_size") or rollup["num_ranks"].max()
        ready = (pl.col("num_ranks") >= expected) | (pl.col("end") < now - self.grace_s)
        held = rollup.filter(~ready)["step"]
        rollup = rollup.filter(ready).drop("end")
        ready_steps = rollup["step"].to_list()
        op_rows = compute.op_rollup(collectives.filter(pl.col("step").is_in(ready_steps)))
        b = state.bucket_steps
        bucket_rows = steps.filter(pl.col("step").is_between(lo - lo % b, hi - hi % b + b - 1))
        replace_rows = partial(
            rollup_tables.replace_step_rows, job_id=self.job_id, steps=ready_steps
        )
        writes += [
            partial(replace_rows, table=tables.step_rollups, frame=rollup),
            partial(replace_rows, table=tables.op_rollups, frame=op_rows),
            partial(
                rollup_tables.write_rank_buckets,
                job_id=self.job_id,
                bucket_steps=b,
                buckets=compute.rank_buckets(bucket_rows, b),
            ),
        ]
        return len(ready_steps), None if held.is_empty() else int(held.min())  # type: ignore[arg-type]

    def _rebucket_steps(self, state: AnalysisState, *, stored: bool) -> list[Write]:
        """Double the rank × step bucket width while the job outgrows MAX_BUCKETS buckets;
        `stored`: the job has committed buckets to merge."""
        assert state.first_step is not None
        assert state.last_step is not None
        width = int(compute.bucket_width(0, state.last_step))
        if width <= state.bucket_steps:
            return []
        writes: list[Write] = [partial(rollup_tables.delete_rank_buckets, job_id=self.job_id)]
        previous = rollup_tables.read_rank_buckets(self.engine, self.job_id) if stored else None
        if previous is not None:
            merged = compute.merge_rank_buckets(previous.frame(), width)
            writes.append(
                partial(
                    rollup_tables.write_rank_buckets,
                    job_id=self.job_id,
                    bucket_steps=width,
                    buckets=merged,
                )
            )
        state.bucket_steps = width
        return writes

    def _job_findings(
        self, conn: sa.Connection, plan: SegmentPlan, job: dict[str, Any], rollup: pl.DataFrame
    ) -> list[schema.Finding]:
        if rollup.is_empty():
            return []
        ops = rollup_tables.read_step_rows(conn, tables.op_rollups, self.job_id, _OP_COLUMNS)
        return job_findings(rollup, None if ops.is_empty() else ops, job, plan, self.config)

    def _gpu_source(self, steps: pl.DataFrame) -> Any:
        """Reads the GPU samples of some ranks over these steps' time, when asked."""
        if steps.is_empty():
            return None
        t0 = steps["ts"].min()
        t1 = (steps["ts"] + steps["step_s"]).max()

        def read(ranks: list[int]) -> pl.DataFrame:
            return frames.read_frame(
                self.engine,
                "gpu",
                self.job_id,
                columns=GPU_COLUMNS,
                ranks=ranks,
                from_ts=float(t0),  # type: ignore[arg-type]
                to_ts=math.nextafter(float(t1), math.inf),  # type: ignore[arg-type]
            )

        return read


def analyze_stored_job(
    engine: sa.Engine,
    job_id: str,
    *,
    full: bool = False,
    grace_s: float = 30.0,
    on_findings: FindingsHook | None = None,
    resources: PassResources | None = None,
    lock_wait_s: float = LOCK_WAIT_S,
) -> list[schema.Finding]:
    """Bring a stored job's rollups and findings up to date (from scratch with `full`), after
    the job's pass running elsewhere, if any (JobBusyError when that takes `lock_wait_s`)."""
    with (
        job_lock(engine, job_id, wait_s=lock_wait_s) as held,
        JobAnalyzer(
            engine, job_id, grace_s=grace_s, on_findings=on_findings, resources=resources
        ) as analyzer,
    ):
        if not held:
            raise JobBusyError(f"job {job_id} is being analysed elsewhere; retry shortly")
        result = analyzer.run(full=full)
    return result.findings if result.findings else findings.load_findings(engine, job_id)
