"""The analysis of one job: job-level findings from its rollups, rank findings segment by
segment, stitched and given causes.

`analyze` lays the post-warm-up steps out as (steps × ranks) matrices once and compares
ranks step by step with robust statistics; no Python loop runs over rows or steps. The
incremental pass (stepscope.pipeline.job_pass) calls the same `segment_findings` and
`combined_findings`, so findings stitched from many passes are those of one analysis.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from stepscope.analysis.communication.collectives import (
    CommEvidence,
    OpGrid,
    finish_times,
    op_grids,
    slow_collective_findings,
    transfer_times,
)
from stepscope.analysis.communication.groups import GroupEvidence
from stepscope.analysis.config import AnalysisConfig
from stepscope.analysis.data.stalls import dataloader_findings
from stepscope.analysis.frames.grid import Grid, Ints, Matrix, column_sample, rank_median
from stepscope.analysis.rollups import op_rollup, step_rollup
from stepscope.analysis.stragglers.findings import Channel, StragglerInput, straggler_findings
from stepscope.analysis.stragglers.rank_levels import MIN_STRETCH_STEPS
from stepscope.analysis.stragglers.segments import SegmentPlan, stitch
from stepscope.analysis.stragglers.telemetry import GpuEvidence, GpuSource
from stepscope.analysis.throughput.causes import with_causes
from stepscope.analysis.throughput.findings import rollup_series, series_findings
from stepscope.schema import COLLECTIVES, Finding

_STEP_COLUMNS = (
    "job_id",
    "rank",
    "step",
    "ts",
    "step_s",
    "data_s",
    "comm_wait_s",
    "compute_s",
    "tokens",
    "samples",
    "flops",
    "node",
)
NUMERIC_STEP_COLUMNS = tuple(c for c in _STEP_COLUMNS if c not in ("job_id", "node"))
"""The step columns the analysis and the rollups read."""
_MAX_REFERENCE_RANKS = 256

Frame = pl.DataFrame | pl.LazyFrame
Meshes = Mapping[int, Mapping[str, Any]]
"""rank -> DeviceMesh coordinates {dim: [coordinate, size]} (stepscope.schema.RANKS mesh)."""


def analyze(
    steps: Frame,
    *,
    collectives: Frame | None = None,
    gpu: Frame | None = None,
    ranks: Frame | None = None,
    job: Mapping[str, Any] | None = None,
    config: AnalysisConfig | None = None,
) -> list[Finding]:
    """All findings about one job: stragglers, data stalls, slow collectives, throughput, MFU.

    Frames use the canonical columns (stepscope.schema); lazy frames are read with only the
    columns needed. A rank's node comes from a `node` column of `steps` or from `ranks`, its
    DeviceMesh coordinates (a straggler's pipeline stage) from the `mesh` column of `ranks`.
    Job-level findings come from the job's rollups, rank-level ones segment by segment
    (stepscope.analysis.stragglers.segments), as the server's incremental analysis does.
    """
    config = config or AnalysisConfig()
    job_id = _job_id(steps, job)
    # Strings are the costliest columns to read: a lazy frame's job_id and node are queried
    # on their own, when needed.
    wanted = _STEP_COLUMNS if isinstance(steps, pl.DataFrame) else NUMERIC_STEP_COLUMNS
    steps_df = _select(steps, wanted).drop("job_id", "node", strict=False)
    if steps_df.is_empty():
        return []
    job = {**(job or {}), "job_id": job_id}
    collectives_df = None
    if collectives is not None:
        collectives_df = _select(collectives, tuple(c for c in COLLECTIVES.names if c != "job_id"))
    if collectives_df is not None and collectives_df.is_empty():
        collectives_df = None
    grid = Grid.of(steps_df["rank"].to_numpy(), steps_df["step"].to_numpy())
    # Only the rollup columns the job-level detectors read (the store keeps them all).
    rollup = step_rollup(steps_df, spread=False, grid=grid)
    ops = None
    if collectives_df is not None:
        ops = op_rollup(collectives_df, spread=False, grid=grid)
    plan = SegmentPlan.of(int(grid.steps[0]), int(job.get("world_size") or grid.ranks.size), config)
    findings = job_findings(rollup, ops, job, plan, config)
    matrices = RankMatrices.of(steps_df, collectives_df, grid)
    times = StepTimes(steps_df, grid)
    nodes = Nodes(steps, ranks)
    meshes = rank_meshes(ranks)
    per_segment = {}
    for k in range(plan.index(int(grid.steps[-1])) + 1):
        first, last = plan.span(k)
        a = int(np.searchsorted(grid.steps, first, side="left"))
        b = int(np.searchsorted(grid.steps, last, side="right"))
        if b > a:
            rows = SegmentRows(matrices=matrices.rows(a, b), times=times)
            per_segment[k] = segment_findings(
                job_id, plan, k, rows, gpu, nodes=nodes, meshes=meshes, config=config
            )
    return _stamped(combined_findings(findings, plan, per_segment, config))


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentRows:
    """The rows of a segment's span laid out for the rank detectors."""

    matrices: RankMatrices
    times: StepTimes

    @classmethod
    def of(cls, steps_df: pl.DataFrame, collectives_df: pl.DataFrame | None) -> SegmentRows:
        """The span's step (and collective) rows on their own grid; steps_df is not empty."""
        grid = Grid.of(steps_df["rank"].to_numpy(), steps_df["step"].to_numpy())
        matrices = RankMatrices.of(steps_df, collectives_df, grid)
        return cls(matrices=matrices, times=StepTimes(steps_df, grid))


def segment_findings(
    job_id: str,
    plan: SegmentPlan,
    k: int,
    rows: SegmentRows,
    gpu: Frame | GpuSource | None,
    *,
    nodes: Mapping[int, str],
    meshes: Meshes | None = None,
    config: AnalysisConfig,
) -> list[Finding]:
    """The rank findings segment k owns (stepscope.analysis.stragglers.segments), from its
    span's rows."""
    settling_steps = config.window_steps if k == 0 else 0
    found = _rank_findings(
        job_id, rows, gpu, nodes=nodes, meshes=meshes, config=config, settling_steps=settling_steps
    )
    return plan.owned(k, found)


def combined_findings(
    job_level: list[Finding],
    plan: SegmentPlan,
    per_segment: Mapping[int, list[Finding]],
    config: AnalysisConfig,
) -> list[Finding]:
    """A job's findings: its job-level ones and its segments' stitched, with their causes."""
    return with_causes(job_level + stitch(plan, per_segment), config)


def job_findings(
    rollup: pl.DataFrame,
    op_rollup: pl.DataFrame | None,
    job: Mapping[str, Any],
    plan: SegmentPlan,
    config: AnalysisConfig,
) -> list[Finding]:
    """Findings from the job's rollups: throughput/MFU shifts, MFU and peak, slow collectives."""
    findings = series_findings(
        rollup_series(rollup),
        job=job,
        config=config.change_points,
        mfu_low_below=config.mfu_low_below,
    )
    if op_rollup is not None:
        findings += slow_collective_findings(str(job["job_id"]), op_rollup, plan.base_step, config)
    return findings


@dataclass(kw_only=True, slots=True)
class RankMatrices:
    """A job's per-step metrics as (steps × ranks) matrices, and its collectives on the grid."""

    ranks: Ints
    steps: Ints
    step_s: Matrix
    data_s: Matrix
    compute_s: Matrix
    comm_wait_s: Matrix | None
    compute_given: bool
    """compute_s came with the steps (else it is derived from step_s, data_s, comm_wait_s)."""
    ops: list[OpGrid]
    collectives: pl.DataFrame | None = None
    """The collectives rows (of these steps or more): who waited for whom in each group."""

    @classmethod
    def of(
        cls, steps_df: pl.DataFrame, collectives_df: pl.DataFrame | None, grid: Grid
    ) -> RankMatrices:
        """The matrices of these step (and collective) rows laid out on `grid`."""

        def matrix(column: str) -> Matrix | None:
            if column not in steps_df.columns or steps_df[column].null_count() == steps_df.height:
                return None
            return grid.matrix(steps_df[column].to_numpy())

        step_s = matrix("step_s")
        data_s = matrix("data_s")
        if step_s is None or data_s is None:
            raise ValueError("steps need step_s and data_s (stepscope.schema.STEPS)")
        comm_wait_s = matrix("comm_wait_s")
        derived = step_s - data_s - (comm_wait_s if comm_wait_s is not None else 0.0)
        compute_s = matrix("compute_s")
        if compute_s is not None:
            derived = np.where(np.isnan(compute_s), derived, compute_s)
        ops = []
        if collectives_df is not None and not collectives_df.is_empty():
            ops = op_grids(collectives_df, grid, 0)
        else:
            collectives_df = None
        return cls(
            ranks=grid.ranks,
            steps=grid.steps,
            step_s=step_s,
            data_s=data_s,
            compute_s=derived,
            comm_wait_s=comm_wait_s,
            compute_given=compute_s is not None,
            ops=ops,
            collectives=collectives_df,
        )

    def rows(self, a: int, b: int) -> RankMatrices:
        """Steps a..b-1 (positions on the step axis), as views."""
        return RankMatrices(
            ranks=self.ranks,
            steps=self.steps[a:b],
            step_s=self.step_s[a:b],
            data_s=self.data_s[a:b],
            compute_s=self.compute_s[a:b],
            comm_wait_s=None if self.comm_wait_s is None else self.comm_wait_s[a:b],
            compute_given=self.compute_given,
            ops=[op.rows(a, b) for op in self.ops],
            collectives=self.collectives,
        )


def rank_findings(
    job_id: str,
    steps_df: pl.DataFrame,
    collectives_df: pl.DataFrame | None,
    gpu: Frame | GpuSource | None,
    *,
    nodes: Mapping[int, str],
    meshes: Meshes | None = None,
    config: AnalysisConfig,
) -> list[Finding]:
    """Stragglers and data stalls among the ranks over all of these steps (no warm-up skipped)."""
    if steps_df.is_empty():
        return []
    rows = SegmentRows.of(steps_df, collectives_df)
    return _rank_findings(job_id, rows, gpu, nodes=nodes, meshes=meshes, config=config)


def _rank_findings(
    job_id: str,
    rows: SegmentRows,
    gpu: Frame | GpuSource | None,
    *,
    nodes: Mapping[int, str],
    meshes: Meshes | None,
    config: AnalysisConfig,
    settling_steps: int = 0,
) -> list[Finding]:
    m, times = rows.matrices, rows.times
    m = m.rows(0, complete_steps(m.step_s))
    if m.steps.size < 2 * MIN_STRETCH_STEPS:
        return []
    stride = max(1, m.ranks.size // _MAX_REFERENCE_RANKS)
    reference_step_s = rank_median(m.step_s[:, ::stride])
    data_median_s = rank_median(column_sample(m.data_s))

    channels: dict[Channel, Matrix] = {"compute": m.compute_s, "data": m.data_s}
    ready_s = None if m.comm_wait_s is None else m.step_s - m.comm_wait_s
    finish_s = finish_times(m.ops, ready_s) if m.ops else None
    if finish_s is not None:  # a pipeline's sends and receives alone make none
        channels["communication"] = finish_s

    gpu_evidence = None
    if gpu is not None and times.has_ts:
        # Telemetry is read only if a rank is slow to compute, and only its rows and peers'.
        gpu_evidence = GpuEvidence(gpu, times, config, ranks=m.ranks)
    stragglers = straggler_findings(
        StragglerInput(
            job_id=job_id,
            ranks=m.ranks,
            steps=m.steps,
            step_s=m.step_s,
            reference_step_s=reference_step_s,
            channels=channels,
            medians={"data": data_median_s},
            comm_wait_s=m.comm_wait_s,
            transfer_s=transfer_times(m.ops) if m.ops else None,
            compute_includes_wait=m.comm_wait_s is None and not m.compute_given,
            nodes=nodes,
            gpu_evidence=gpu_evidence,
            comm_evidence=CommEvidence(m.ops, m.steps, m.ranks) if m.ops else None,
            group_evidence=GroupEvidence(m.collectives) if m.collectives is not None else None,
            meshes=meshes or {},
            settling_steps=settling_steps,
        ),
        config,
    )
    return stragglers + dataloader_findings(
        job_id=job_id,
        ranks=m.ranks,
        steps=m.steps,
        data_s=m.data_s,
        data_median_s=data_median_s,
        reference_step_s=reference_step_s,
        data_straggler_ranks={r for f in stragglers if f.cause == "data" for r in f.ranks},
        config=config,
    )


def complete_steps(step_s: Matrix) -> int:
    """How many leading steps to compare ranks over: the steps up to the last one reported by
    as many ranks as the median step, so a live job's last steps, still arriving from some
    ranks only, are left out.

    A step reported by few ranks has its median from those few: a rank ahead of the others
    sits near its own median there, one behind counts as typical (residual 0), either way
    below its usual level against its peers, and the steps before look slower than its own
    level — a rank with a small persistent offset became an "own"-reference straggler from
    the first step after warm-up to shortly before the ragged tail.
    """
    reported = np.count_nonzero(~np.isnan(step_s), axis=1)
    if reported.size == 0 or reported[-1] >= reported.max():
        return int(reported.size)
    typical = np.median(reported)
    return int(np.flatnonzero(reported >= typical)[-1]) + 1


def _schema(frame: Frame) -> pl.Schema:
    return frame.collect_schema() if isinstance(frame, pl.LazyFrame) else frame.schema


def _select(frame: Frame, names: tuple[str, ...]) -> pl.DataFrame:
    schema = _schema(frame)
    selected = frame.select(c for c in names if c in schema)
    return selected.collect() if isinstance(selected, pl.LazyFrame) else selected


def _job_id(steps: Frame, job: Mapping[str, Any] | None) -> str:
    if "job_id" in _schema(steps):
        job_ids = pl.col("job_id").drop_nulls()
        first, mixed = (
            steps.select(
                job_ids.first().alias("first"), (job_ids != job_ids.first()).any().alias("mixed")
            )
            .lazy()
            .collect()
            .row(0)
        )
        if mixed:
            raise ValueError("steps hold more than one job_id: analyse one job at a time")
        if first is not None:
            return str(first)
    if job and job.get("job_id"):
        return str(job["job_id"])
    raise ValueError("no job_id: give steps a job_id column or pass job={'job_id': ...}")


def _stamped(findings: list[Finding]) -> list[Finding]:
    now = time.time()
    for f in findings:
        f.detected_at = now
    return findings


class StepTimes:
    """(rank, first_step, last_step) -> wall-clock span of those steps on that rank."""

    def __init__(self, steps: pl.DataFrame, grid: Grid) -> None:
        self._steps = steps
        self._grid = grid

    @property
    def has_ts(self) -> bool:
        return "ts" in self._steps.columns

    def __call__(self, window: tuple[int, int, int]) -> tuple[float, float] | None:
        rank, first_step, last_step = window
        grid = self._grid
        r = int(np.searchsorted(grid.ranks, rank))
        a, b = (int(i) for i in np.searchsorted(grid.steps, [first_step, last_step]))
        first_row, last_row = grid.row_of(r, a), grid.row_of(r, b)
        if first_row is not None and last_row is not None:
            t0 = self._steps["ts"][first_row]
            t1 = self._steps["ts"][last_row] + self._steps["step_s"][last_row]
        else:
            t0, t1 = (
                self._steps.filter(
                    (pl.col("rank") == rank) & pl.col("step").is_between(first_step, last_step)
                )
                .select(pl.col("ts").min(), (pl.col("ts") + pl.col("step_s")).max().alias("end"))
                .row(0)
            )
        return None if t0 is None or t1 is None else (float(t0), float(t1))


def rank_meshes(ranks: Frame | None) -> dict[int, dict[str, Any]]:
    """rank -> DeviceMesh coordinates, from the `mesh` column of a ranks frame (JSON text as
    stored, or objects); ranks without one are left out."""
    if ranks is None or "mesh" not in _schema(ranks):
        return {}
    frame = _select(ranks, ("rank", "mesh")).drop_nulls("mesh")
    out: dict[int, dict[str, Any]] = {}
    for rank, mesh in frame.iter_rows():
        value = json.loads(mesh) if isinstance(mesh, str) else mesh
        if isinstance(value, dict):
            out[int(rank)] = {k: v for k, v in value.items() if v is not None}
    return out


class Nodes(Mapping[int, str]):
    """rank -> node, read from `ranks` or the steps' node column only when first needed."""

    def __init__(self, steps: Frame, ranks: Frame | None) -> None:
        self._steps = steps
        self._ranks = ranks
        self._map: dict[int, str] | None = None

    def _load(self) -> dict[int, str]:
        if self._map is None:
            self._map = {}
            frame: pl.DataFrame
            if self._ranks is not None:
                frame = _select(self._ranks, ("rank", "node"))
            elif "node" in _schema(self._steps):
                frame = (
                    self._steps.lazy()
                    .group_by("rank")
                    .agg(pl.col("node").drop_nulls().first())
                    .collect()
                )
            else:
                frame = pl.DataFrame()
            if "node" in frame.columns:
                frame = frame.drop_nulls("node")
                self._map = dict(zip(frame["rank"].to_list(), frame["node"].to_list(), strict=True))
        return self._map

    def __getitem__(self, rank: int) -> str:
        return self._load()[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())
