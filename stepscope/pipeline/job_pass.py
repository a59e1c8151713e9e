"""Incremental analysis of stored jobs: rollups and findings kept current from a watermark.

A pass reads only the job's batches received since its stored watermark (DESIGN §6): it
recomputes the rollups of the steps (and GPU time buckets) those batches touched, re-analyses
the step segments that read those steps (stepscope.analysis.segments), runs the job-level
detectors on the step and collective rollups, and stores findings, state and watermark.
Findings stitched from many passes equal those of one full pass over the same rows.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import polars as pl
import sqlalchemy as sa

from stepscope import schema
from stepscope.analysis import (
    NUMERIC_STEP_COLUMNS,
    AnalysisConfig,
    job_findings,
    rank_findings,
    with_causes,
)
from stepscope.analysis import rollups as compute
from stepscope.analysis.segments import SegmentPlan, stitch
from stepscope.analysis.telemetry import GPU_COLUMNS
from stepscope.pipeline.recent_rows import RecentRows, RecentRowsCache
from stepscope.store import frames, queries, reads, tables
from stepscope.store import rollups as store

log = logging.getLogger(__name__)

OVERLAP_S = 5.0
"""Batches received this long before the watermark are read again: a batch's received_at is
stamped when its transaction starts, so one may commit after a later-stamped one was read."""

_COLLECTIVE_COLUMNS = ("rank", "step", "op", "group_size", "count", "bytes", "busy_s")
_ROLLUP_COLUMNS = [c.name for c in tables.step_rollups.c if c.name != "job_id"]
_OP_COLUMNS = ["step", "op", "group_size", "count", "bytes", "busy_s_min"]
"""What the job-level detectors read of the rollups."""
_SEGMENTS_PER_READ = 8
"""Segments analysed from one read of raw rows (bounds the memory of a full pass)."""
_GPU_RANKS_PER_READ = 64
"""Ranks whose GPU samples a full pass reads and buckets at a time."""
_READS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stepscope-read")
"""Reads of a pass's step and collective rows, side by side."""
_RECENT = RecentRowsCache()
"""The rows of each live job's last segment, from its previous pass in this process."""


FindingsHook = Callable[[str, list[schema.Finding]], None]
"""Called after a pass stored a job's findings, with its warning and critical ones (the
webhook sender): it must return at once; an error in it is logged, never raised."""


class RawRowsPrunedError(RuntimeError):
    """A full re-analysis of a job whose raw rows `stepscope db prune` deleted."""


@dataclass(kw_only=True, slots=True)
class PassResult:
    """What one pass did."""

    rolled_up_steps: int = 0
    analysed_segments: list[int] = field(default_factory=list)
    findings: list[schema.Finding] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class _State:
    """A job's analysis state, kept as JSON in `analysis_state`."""

    plan: SegmentPlan | None = None
    bucket_steps: int = 1
    gpu_bucket_s: float = 1.0
    first_step: int | None = None
    last_step: int | None = None
    first_gpu_ts: float | None = None
    last_gpu_ts: float | None = None
    raw_pruned_before: float | None = None
    """Set by `stepscope db prune --keep-rollups`: only rollups remain of older rows."""
    pending_from: int | None = None
    """Smallest step held back from the step rollups: not every rank has reported it yet."""
    overlap_batches: int = 0
    """Batches received within OVERLAP_S before the watermark, as of the last pass."""
    segments: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    @classmethod
    def of(cls, doc: dict[str, Any]) -> _State:
        plan = doc.pop("plan", None)
        segments = {int(k): v for k, v in doc.pop("segments", {}).items()}
        return cls(plan=SegmentPlan(**plan) if plan else None, segments=segments, **doc)

    def doc(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "plan": None
            if plan is None
            else {
                "base_step": plan.base_step,
                "segment_steps": plan.segment_steps,
                "context_steps": plan.context_steps,
            },
            "bucket_steps": self.bucket_steps,
            "gpu_bucket_s": self.gpu_bucket_s,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "first_gpu_ts": self.first_gpu_ts,
            "last_gpu_ts": self.last_gpu_ts,
            "pending_from": self.pending_from,
            "raw_pruned_before": self.raw_pruned_before,
            "overlap_batches": self.overlap_batches,
            "segments": {str(k): v for k, v in self.segments.items()},
        }


def _merged(older: pl.DataFrame, newer: pl.DataFrame) -> pl.DataFrame:
    """Rows of earlier and of later steps, each ordered by (rank, step, ...), in that order."""
    key = (pl.col("rank") * (1 << 32) + pl.col("step")).alias("_rank_step")
    return (
        older.with_columns(key)
        .merge_sorted(newer.with_columns(key), "_rank_step")
        .drop("_rank_step")
    )


def _widen(lo: Any, hi: Any, a: Any, b: Any) -> tuple[Any, Any]:
    """The union of two ranges, either of which may be unknown (None)."""
    lo = a if lo is None else lo if a is None else min(lo, a)
    hi = b if hi is None else hi if b is None else max(hi, b)
    return lo, hi


class JobAnalyzer:
    """Runs incremental passes over one job of a store."""

    def __init__(
        self,
        engine: sa.Engine,
        job_id: str,
        *,
        config: AnalysisConfig | None = None,
        grace_s: float = 30.0,
        on_findings: FindingsHook | None = None,
    ) -> None:
        self.engine = engine
        self.job_id = job_id
        self.config = config or AnalysisConfig()
        self.grace_s = grace_s
        self.on_findings = on_findings

    def run(self, *, full: bool = False) -> PassResult:
        """One pass: from the stored watermark, or from scratch with `full`."""
        loaded = store.load_state(self.engine, self.job_id)
        if full:
            if loaded is not None and loaded[1].get("raw_pruned_before") is not None:
                raise RawRowsPrunedError(
                    f"the raw rows of job {self.job_id} were pruned: a full re-analysis would "
                    "lose its rollups and findings"
                )
            with self.engine.begin() as conn:
                store.delete_job_rollups(conn, self.job_id)
            loaded = None
        state = _State() if loaded is None else _State.of(loaded[1])
        watermark = -math.inf if loaded is None else loaded[0]
        database = self.engine.url.render_as_string()
        recent = _RECENT.take(database, self.job_id, watermark) if loaded is not None else None
        arrivals = store.arrivals_since(self.engine, self.job_id, watermark)
        late = store.count_batches(self.engine, self.job_id, watermark - OVERLAP_S, watermark)
        if late > state.overlap_batches:  # committed after the last pass read past them
            arrivals = store.arrivals_since(self.engine, self.job_id, watermark - OVERLAP_S)
        result = PassResult()
        if arrivals is None and state.pending_from is None:
            return result
        job = queries.load_job(self.engine, self.job_id) or {"job_id": self.job_id}
        now = time.time()
        tail: RecentRows | None = None

        lo, hi = state.pending_from, None
        if arrivals is not None:
            lo, hi = _widen(lo, hi, arrivals.first_step, arrivals.last_step)
        state.first_step, state.last_step = _widen(state.first_step, state.last_step, lo, hi)
        # GPU time buckets are made beside the steps' rollups and segments (they share no
        # state or table): each part waits mostly on its reads.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepscope-gpu") as gpu_pool:
            gpu = None
            if arrivals is not None and arrivals.first_gpu_ts is not None:
                gpu = gpu_pool.submit(self._gpu, state, arrivals.first_gpu_ts, arrivals.last_gpu_ts)
            if lo is not None and state.first_step is not None and state.last_step is not None:
                if state.plan is None:
                    num_ranks = int(job.get("world_size") or len(self._nodes_and_ranks()[1]))
                    state.plan = SegmentPlan.of(state.first_step, num_ranks, self.config)
                self._rebucket_steps(state)
                result.rolled_up_steps, state.pending_from, tail = self._steps(
                    state, job, lo, hi if hi is not None else state.last_step, now, result, recent
                )
            if gpu is not None:
                gpu.result()

        rollup = reads.read_rollup(
            self.engine, tables.step_rollups, self.job_id, columns=_ROLLUP_COLUMNS
        )
        findings = self._job_findings(state, job, rollup)
        if state.plan is not None:
            per_segment = {
                k: [schema.Finding(**f) for f in found] for k, found in state.segments.items()
            }
            findings += stitch(state.plan, per_segment)
        findings = with_causes(findings, self.config)
        # A batch stamped within OVERLAP_S before the new watermark may still be committing:
        # the next pass re-reads that stretch if it then holds more batches than now.
        if arrivals is not None:
            watermark = arrivals.received_at
        state.overlap_batches = store.count_batches(
            self.engine, self.job_id, watermark - OVERLAP_S, watermark
        )
        with self.engine.begin() as conn:
            store.save_state(conn, self.job_id, watermark, state.doc(), now)
        if tail is not None:
            _RECENT.put(database, self.job_id, replace(tail, watermark=watermark))
        queries.replace_findings(self.engine, self.job_id, findings)
        result.findings = queries.load_findings(self.engine, self.job_id)
        self._notify(result.findings)
        if not rollup.is_empty() and state.plan is not None:
            summary = compute.steady_summary(rollup, state.plan.base_step)
            severities = Counter(str(f.severity) for f in result.findings)
            with self.engine.begin() as conn:
                store.save_summary(conn, self.job_id, summary, severities, now)
        return result

    def _notify(self, findings: list[schema.Finding]) -> None:
        if self.on_findings is None:
            return
        try:
            self.on_findings(self.job_id, [f for f in findings if f.severity != "info"])
        except Exception:
            log.exception("the findings hook failed for job %s", self.job_id)

    # --- steps and collectives: rollups and segments -------------------------------------

    def _steps(
        self,
        state: _State,
        job: dict[str, Any],
        lo: int,
        hi: int,
        now: float,
        result: PassResult,
        recent: RecentRows | None,
    ) -> tuple[int, int | None, RecentRows | None]:
        """Roll up steps lo..hi and re-analyse the segments reading them; (rolled up, first
        step held back, the rows the next pass will read again)."""
        plan = state.plan
        assert plan is not None
        assert state.last_step is not None
        touched = [k for k in plan.touched(lo, hi) if plan.start(k) <= state.last_step]
        groups = [
            touched[i : i + _SEGMENTS_PER_READ] for i in range(0, len(touched), _SEGMENTS_PER_READ)
        ] or [[]]
        b = state.bucket_steps
        rolled_up, pending = 0, None
        nodes, ranks = self._nodes_and_ranks()
        for i, group in enumerate(groups):
            # This read's share of the dirty steps (the first also takes the warm-up's), and
            # what it must read: those steps' whole rank buckets and its segments' spans.
            own_lo = lo if i == 0 else max(lo, plan.start(group[0]))
            own_hi = hi if i == len(groups) - 1 else min(hi, plan.start(group[-1] + 1) - 1)
            read_lo, read_hi = own_lo - own_lo % b, own_hi - own_hi % b + b - 1
            if group:
                read_lo, read_hi = _widen(
                    read_lo, read_hi, plan.span(group[0])[0], plan.span(group[-1])[1]
                )
            steps, collectives = self._read_rows(read_lo, read_hi, lo, sorted(ranks), recent)
            if own_lo <= own_hi:
                n, held = self._roll_up(state, job, steps, collectives, own_lo, own_hi, now)
                rolled_up += n
                if held is not None:
                    pending = held if pending is None else min(pending, held)
            for k in group:
                in_span = pl.col("step").is_between(*plan.span(k))
                span_steps = steps.filter(in_span)
                found = rank_findings(
                    self.job_id,
                    span_steps,
                    collectives.filter(in_span),
                    self._gpu_source(span_steps),
                    nodes=nodes,
                    config=self.config,
                )
                state.segments[k] = [f.to_dict() for f in plan.owned(k, found)]
                result.analysed_segments.append(k)
        # The next pass re-reads the last segment's span and the last step's rank bucket.
        last = state.last_step
        keep_from = max(read_lo, min(plan.span(plan.index(last))[0], last - last % b))
        if read_hi < last or keep_from > read_hi:
            return rolled_up, pending, None
        kept = pl.col("step") >= keep_from
        tail = RecentRows(
            watermark=math.nan,
            first_step=keep_from,
            last_step=read_hi,
            steps=steps.filter(kept),
            collectives=collectives.filter(kept),
        )
        return rolled_up, pending, tail

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
        read = list(
            _READS.map(
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
        state: _State,
        job: dict[str, Any],
        steps: pl.DataFrame,
        collectives: pl.DataFrame,
        lo: int,
        hi: int,
        now: float,
    ) -> tuple[int, int | None]:
        """Rollups of steps lo..hi from their raw rows; (steps rolled up, first step held back)."""
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
        with self.engine.begin() as conn:
            store.replace_step_rows(conn, tables.step_rollups, self.job_id, rollup, ready_steps)
            store.replace_step_rows(conn, tables.op_rollups, self.job_id, op_rows, ready_steps)
            store.write_rank_buckets(conn, self.job_id, b, compute.rank_buckets(bucket_rows, b))
        return len(ready_steps), None if held.is_empty() else int(held.min())  # type: ignore[arg-type]

    def _rebucket_steps(self, state: _State) -> None:
        """Double the rank × step bucket width while the job outgrows MAX_BUCKETS buckets."""
        assert state.first_step is not None
        assert state.last_step is not None
        width = int(compute.bucket_width(0, state.last_step))
        if width <= state.bucket_steps:
            return
        stored = store.read_rank_buckets(self.engine, self.job_id)
        with self.engine.begin() as conn:
            conn.execute(
                sa.delete(tables.rank_buckets).where(tables.rank_buckets.c.job_id == self.job_id)
            )
            if stored is not None:
                merged = compute.merge_rank_buckets(stored.frame(), width)
                store.write_rank_buckets(conn, self.job_id, width, merged)
        state.bucket_steps = width

    def _job_findings(
        self, state: _State, job: dict[str, Any], rollup: pl.DataFrame
    ) -> list[schema.Finding]:
        if rollup.is_empty() or state.plan is None:
            return []
        ops = reads.read_rollup(self.engine, tables.op_rollups, self.job_id, columns=_OP_COLUMNS)
        return job_findings(rollup, None if ops.is_empty() else ops, job, state.plan, self.config)

    def _nodes_and_ranks(self) -> tuple[dict[int, str], list[int]]:
        ranks = frames.read_frame(self.engine, "ranks", self.job_id, columns=["rank", "node"])
        named = ranks.drop_nulls("node")
        nodes = dict(zip(named["rank"].to_list(), named["node"].to_list(), strict=True))
        return nodes, ranks["rank"].to_list()

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

    # --- GPU time buckets ------------------------------------------------------------------

    def _gpu(self, state: _State, first_ts: float, last_ts: float | None) -> None:
        state.first_gpu_ts, state.last_gpu_ts = _widen(
            state.first_gpu_ts, state.last_gpu_ts, first_ts, last_ts
        )
        assert state.first_gpu_ts is not None
        assert state.last_gpu_ts is not None
        width = compute.bucket_width(state.first_gpu_ts, state.last_gpu_ts)
        if width > state.gpu_bucket_s:
            stored = store.read_gpu_buckets(self.engine, self.job_id)
            with self.engine.begin() as conn:
                conn.execute(
                    sa.delete(tables.gpu_buckets).where(tables.gpu_buckets.c.job_id == self.job_id)
                )
                if stored is not None:
                    merged = compute.merge_gpu_buckets(stored[1], width)
                    spread = compute.gpu_spread(merged)
                    store.write_gpu_buckets(conn, self.job_id, width, merged, spread)
            state.gpu_bucket_s = width
        w = state.gpu_bucket_s
        if first_ts <= state.first_gpu_ts:  # from the job's first sample: read them all
            # a few ranks at a time along the key (a time-range read of a whole job goes
            # through the ts index, row by row), bucketed as they come
            ranks = self._nodes_and_ranks()[1]
            if not ranks:  # samples come with their rank's first batch
                return
            buckets = pl.concat(
                [
                    compute.gpu_buckets(
                        frames.read_frame(
                            self.engine,
                            "gpu",
                            self.job_id,
                            columns=compute.GPU_BUCKET_COLUMNS,
                            ranks=ranks[i : i + _GPU_RANKS_PER_READ],
                        ),
                        w,
                    )
                    for i in range(0, len(ranks), _GPU_RANKS_PER_READ)
                ]
            ).sort("first_ts", "rank", "gpu_index")
        else:
            samples = frames.read_frame(
                self.engine,
                "gpu",
                self.job_id,
                columns=compute.GPU_BUCKET_COLUMNS,
                from_ts=math.floor(first_ts / w) * w,
                to_ts=(math.floor((last_ts or first_ts) / w) + 1) * w,
            )
            buckets = compute.gpu_buckets(samples, w)
        with self.engine.begin() as conn:
            store.write_gpu_buckets(conn, self.job_id, w, buckets, compute.gpu_spread(buckets))


def analyze_stored_job(
    engine: sa.Engine,
    job_id: str,
    *,
    full: bool = False,
    grace_s: float = 30.0,
    on_findings: FindingsHook | None = None,
) -> list[schema.Finding]:
    """Bring a stored job's rollups and findings up to date (from scratch with `full`)."""
    result = JobAnalyzer(engine, job_id, grace_s=grace_s, on_findings=on_findings).run(full=full)
    return result.findings if result.findings else queries.load_findings(engine, job_id)
