"""Response models of the REST API, built from the query layer's results.

Floats that are unknown (None or NaN in the query results) are JSON null. Arrays are
per-point lists (`step[i]`, `value[i]`), so a 2,000-point series stays small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field

from stepscope import query, schema
from stepscope.schema import Cause, FindingKind, Severity
from stepscope.text.findings import finding_line, job_cost

if TYPE_CHECKING:
    JobStatus = str
else:
    JobStatus = Literal[query.JOB_STATUSES]

Floats = list[float | None]


def floats(values: NDArray[np.floating[Any]]) -> Floats:
    """A float array as a list; NaN stays NaN and is written as JSON null."""
    out: Floats = values.astype(np.float64).tolist()
    return out


def ints(values: NDArray[np.integer[Any]]) -> list[int]:
    out: list[int] = values.astype(np.int64).tolist()
    return out


class ErrorRead(BaseModel):
    """An error: what was wrong and what to do."""

    detail: str


class ParameterError(BaseModel):
    parameter: str
    """The request parameter (query, path or body field) that is wrong."""
    message: str


class ValidationErrorRead(BaseModel):
    """A 422: every wrong parameter, named, with what it must be."""

    detail: str
    errors: list[ParameterError]


class JobRead(BaseModel):
    """One job of the list; summary figures and finding counts are null before analysis."""

    model_config = ConfigDict(from_attributes=True)

    job_id: str
    name: str | None
    benchmark_key: str | None
    status: JobStatus
    world_size: int | None
    num_nodes: int | None
    started_at: float | None
    ended_at: float | None
    last_seen: float | None
    step_p50_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    num_info: int | None
    num_warning: int | None
    num_critical: int | None

    @classmethod
    def of(cls, row: query.JobRow) -> JobRead:
        return cls.model_validate(row)


class JobsPage(BaseModel):
    """A page of jobs; pass next_cursor as `cursor` for the next page (null on the last)."""

    jobs: list[JobRead]
    next_cursor: str | None

    @classmethod
    def of(cls, page: query.JobsPage) -> JobsPage:
        return cls(jobs=[JobRead.of(j) for j in page.jobs], next_cursor=page.next_cursor)


class JobSummaryRead(BaseModel):
    """A job: size, progress, status, steady-state figures (null until first analysed),
    the data, compute and comm-wait shares of the ranks' step time, findings by severity."""

    model_config = ConfigDict(from_attributes=True)

    job_id: str
    name: str | None
    benchmark_key: str | None
    status: JobStatus
    world_size: int | None
    num_nodes: int | None
    num_ranks_seen: int | None
    num_steps: int | None
    first_step: int | None
    last_step: int | None
    device_name: str | None
    peak_flops: float | None
    started_at: float | None
    ended_at: float | None
    last_seen: float | None
    step_p50_s: float | None
    step_p90_s: float | None
    tokens_per_s: float | None
    samples_per_s: float | None
    mfu: float | None
    data_share: float | None
    compute_share: float | None
    comm_wait_share: float | None
    num_info: int | None
    num_warning: int | None
    num_critical: int | None
    analysed_at: float | None
    attributes: dict[str, Any] | None
    num_records_dropped: int
    """Records the job's profilers dropped (buffer full while the collector was unreachable)
    and reported: the stored rows miss exactly these."""

    @classmethod
    def of(cls, summary: query.JobSummary) -> JobSummaryRead:
        return cls.model_validate(summary)


class MetricPointRead(BaseModel):
    """An OTLP metric point received at /v1/metrics (not GPU telemetry), as stored."""

    rank: int
    name: str
    attributes: dict[str, Any]
    ts: float
    kind: Literal["gauge", "sum", "histogram"]
    unit: str | None
    value: float | None
    """A gauge's or sum's value; a histogram's sum."""
    count: int | None
    min: float | None
    max: float | None
    bounds: list[float] | None
    bucket_counts: list[int] | None


class FindingRead(BaseModel):
    """A finding of the analysis, with its one-line text and, when known, its cost."""

    id: int
    job_id: str
    kind: FindingKind
    severity: Severity
    ranks: list[int]
    node: str | None
    first_step: int | None
    last_step: int | None
    """null while it goes on."""
    metric: str | None
    expected: float | None
    observed: float | None
    effect: float | None
    """Relative, signed: observed / expected − 1."""
    cause: Cause | None
    evidence: dict[str, Any]
    detected_at: float | None
    text: str
    """One readable line (at most 80 characters)."""
    job_cost: float | None
    """Share of the job's step time this finding costs, where known."""

    @classmethod
    def of(cls, f: query.StoredFinding) -> FindingRead:
        fields = {name: getattr(f, name) for name in (*schema.FINDINGS.names, "id")}
        fields["ranks"] = list(f.ranks or ())
        fields["evidence"] = dict(f.evidence or {})
        return cls(**fields, text=finding_line(f), job_cost=job_cost(f))


class SeriesRead(BaseModel):
    """A metric over steps (at most max_points, the extremes kept): value[i] at step[i]."""

    metric: str
    agg: str | None
    """The aggregate across ranks; null for job-level metrics and one rank's values."""
    rank: int | None
    step: list[int]
    value: Floats
    num_steps: int
    """Steps with a value before downsampling."""

    @classmethod
    def of(cls, s: query.Series) -> SeriesRead:
        return cls(
            metric=s.metric,
            agg=s.agg,
            rank=s.rank,
            step=ints(s.step),
            value=floats(s.value),
            num_steps=s.num_steps,
        )


class RankRead(BaseModel):
    """One rank: each time component's median (over step buckets of its bucket means, s)
    and mean, its excess over the job's median rank, and how often it was the slowest."""

    rank: int
    node: str | None
    median_s: dict[str, float | None]
    mean_s: dict[str, float | None]
    excess_s: dict[str, float | None]
    """median_s minus the median over ranks of median_s, per component."""
    compute_excess: float | None
    """Relative: compute_s median / the median rank's − 1."""
    step_excess: float | None
    slowest_share: float | None
    """Share of the job's rolled-up steps in which this rank had the longest step."""
    finding_ids: list[int]


class RankGroupRead(BaseModel):
    """A node's ranks, or the ranks at one coordinate of a mesh dimension: per time
    component the median over its ranks of their median_s (its typical rank) and the max
    (its slowest rank's), the excess over the median group, how often one of its ranks was
    the slowest."""

    group: str | None
    """The node, or the coordinate in the mesh dimension (decimal); null: ranks without one."""
    ranks: list[int]
    slowest_rank: int
    """Its rank of the largest median data_s + compute_s."""
    median_s: dict[str, float | None]
    max_s: dict[str, float | None]
    excess_s: dict[str, float | None]
    """median_s minus the median over groups of median_s, per component."""
    compute_excess: float | None
    """Relative: compute_s median / the median group's − 1."""
    step_excess: float | None
    slowest_share: float | None
    finding_ids: list[int]


def _per_row(values: dict[str, NDArray[np.float64]], n: int) -> list[dict[str, float | None]]:
    """metric → array, as one {metric: value} per row."""
    lists = {m: floats(v) for m, v in values.items()}
    return [{m: v[i] for m, v in lists.items()} for i in range(n)]


def _groups_read(g: query.RankGroups) -> list[RankGroupRead]:
    n = len(g.group)
    median, maximum, excess = (_per_row(v, n) for v in (g.median, g.max, g.excess_s))
    compute, step, share = (floats(v) for v in (g.compute_excess, g.step_excess, g.slowest_share))
    return [
        RankGroupRead(
            group=g.group[i],
            ranks=g.ranks[i],
            slowest_rank=int(g.slowest_rank[i]),
            median_s=median[i],
            max_s=maximum[i],
            excess_s=excess[i],
            compute_excess=compute[i],
            step_excess=step[i],
            slowest_share=share[i],
            finding_ids=g.finding_ids[i],
        )
        for i in range(n)
    ]


class RankTableRead(BaseModel):
    """Every rank of the job, slowest first (by median data_s + compute_s); grouped by node
    or a mesh dimension, also every group, slowest first (by its median)."""

    bucket_steps: int | None
    group_by: str
    """rank, node or a mesh dimension."""
    ranks: list[RankRead]
    groups: list[RankGroupRead] | None
    """null with group_by=rank."""

    @classmethod
    def of(cls, t: query.RankTable, groups: query.RankGroups | None = None) -> RankTableRead:
        median, mean, excess = (_per_row(v, t.rank.size) for v in (t.median, t.mean, t.excess_s))
        compute, step, slowest = (
            floats(t.compute_excess),
            floats(t.step_excess),
            floats(t.slowest_share),
        )
        return cls(
            bucket_steps=t.bucket_steps,
            group_by="rank" if groups is None else groups.group_by,
            groups=None if groups is None else _groups_read(groups),
            ranks=[
                RankRead(
                    rank=rank,
                    node=t.node[i],
                    median_s=median[i],
                    mean_s=mean[i],
                    excess_s=excess[i],
                    compute_excess=compute[i],
                    step_excess=step[i],
                    slowest_share=slowest[i],
                    finding_ids=t.finding_ids[i],
                )
                for i, rank in enumerate(ints(t.rank))
            ],
        )


class HeatmapRead(BaseModel):
    """A rank × step grid (rows of ranks by node, or of a group's ranks: a node, a mesh
    coordinate; columns of steps), values quantised to uint8 over `scale`, zlib-deflated
    and base64-encoded (stepscope.query.decode_values): value = scale[0] + q / 254 ×
    (scale[1] − scale[0]); q = `null` for an empty cell. A cell is the mean (stat=mean)
    over all its row's ranks' steps in it, or their max."""

    metric: str
    stat: str
    group_by: str
    """rank, node or a mesh dimension."""
    groups: list[str | None] | None
    """Each row's node or mesh coordinate (decimal; null: ranks without one, "a–b": a row
    of several); null with group_by=rank."""
    ranks: list[int]
    """First rank of each row."""
    rank_order: list[int] | None
    """Every rank in display order when rows group several ranks (else null)."""
    row_starts: list[int] | None
    """Offset in rank_order of each row's first rank, and len(rank_order) last."""
    nodes: list[str | None]
    step_edges: list[int]
    """Column j covers steps step_edges[j] <= step < step_edges[j + 1]."""
    shape: list[int]
    scale: list[float]
    null: int
    encoding: str
    values: str

    @classmethod
    def of(
        cls, heat: query.Heatmap | None, metric: str, stat: str, group_by: str = "rank"
    ) -> HeatmapRead:
        if heat is None:  # before the job's first rollup: an empty grid
            empty = np.empty(0, dtype=np.int64)
            heat = query.Heatmap(
                metric=metric,
                stat=stat,
                group_by=group_by,
                groups=None if group_by == "rank" else [],
                rank_order=empty,
                row_starts=np.zeros(1, dtype=np.int64),
                ranks=empty,
                nodes=[],
                step_edges=empty,
                values=np.empty((0, 0), dtype=np.float32),
            )
        return cls(**heat.encode())


class SizeRead(BaseModel):
    """A process group, op and message-size bucket (floor(log2(bytes per call)); -1
    without bytes): medians over its steps of the median rank's busbw (waiting included)
    and of the fastest rank's (transfer) bus and algorithm bandwidth, in bytes/s."""

    group: str
    """The group's label: its mesh dimension (every tp group is "tp"), else "group
    <name>", "all" when not known."""
    op: str
    size_log2: int
    num_steps: int
    bytes_per_call_p50: float | None
    busbw_p50_bps: float | None
    transfer_busbw_p50_bps: float | None
    algbw_p50_bps: float | None


class OpSeriesRead(BaseModel):
    """An op's bus bandwidth in a process group over steps: median and slowest rank,
    bytes/s."""

    group: str
    op: str
    step: list[int]
    busbw_p50_bps: Floats
    busbw_min_bps: Floats


class CollectivesRead(BaseModel):
    """A job's collectives per (group, op) and message size, and per (group, op) over steps."""

    sizes: list[SizeRead]
    series: list[OpSeriesRead]

    @classmethod
    def of(cls, c: query.CollectiveStats) -> CollectivesRead:
        s = c.sizes
        columns = (
            ints(s.size_log2),
            ints(s.num_steps),
            floats(s.bytes_per_call_p50),
            floats(s.busbw_p50_bps),
            floats(s.transfer_busbw_p50_bps),
            floats(s.algbw_p50_bps),
        )
        return cls(
            sizes=[
                SizeRead(
                    group=group,
                    op=op,
                    size_log2=size,
                    num_steps=n,
                    bytes_per_call_p50=per_call,
                    busbw_p50_bps=busbw,
                    transfer_busbw_p50_bps=transfer,
                    algbw_p50_bps=algbw,
                )
                for group, op, size, n, per_call, busbw, transfer, algbw in zip(
                    s.group, s.op, *columns, strict=True
                )
            ],
            series=[
                OpSeriesRead(
                    group=o.group,
                    op=o.op,
                    step=ints(o.step),
                    busbw_p50_bps=floats(o.busbw_p50_bps),
                    busbw_min_bps=floats(o.busbw_min_bps),
                )
                for o in c.series
            ],
        )


class MeshRead(BaseModel):
    """The job's DeviceMesh as its ranks sent it: dimensions outer to inner with their
    sizes, each rank's coordinates, and what the heatmap and rank table can group by."""

    dims: list[str]
    sizes: list[int]
    group_by: list[str]
    """rank, node, then each mesh dimension."""
    ranks: list[int]
    coords: list[list[int | None]]
    """Per rank, its coordinate in each of dims (null where it sent none)."""

    @classmethod
    def of(cls, m: query.Mesh) -> MeshRead:
        return cls(
            dims=m.dims,
            sizes=ints(m.sizes),
            group_by=m.group_by,
            ranks=ints(m.ranks),
            coords=[[c if c >= 0 else None for c in row] for row in m.coords.tolist()],
        )


class GpuRead(BaseModel):
    """GPU telemetry per time bucket [ts[i], ts[i] + bucket_s): per device of one rank
    (gpu_index[i]; values: each metric's mean, temp_c_max, sm_clock_mhz_min,
    mem_used_bytes_max) or across the job's devices (values: {metric}_min, _p50, _max of
    the devices' means). Empty lists for a job without samples."""

    rank: int | None
    bucket_s: float | None
    ts: list[float]
    gpu_index: list[int] | None
    num_devices: list[int]
    values: dict[str, Floats]
    throttle_reasons: list[int]
    """OR of the NVML clocks-event reasons in the bucket."""

    @classmethod
    def of(cls, g: query.GpuSeries | None, rank: int | None) -> GpuRead:
        if g is None:
            return cls(
                rank=rank,
                bucket_s=None,
                ts=[],
                gpu_index=None if rank is None else [],
                num_devices=[],
                values={},
                throttle_reasons=[],
            )
        return cls(
            rank=g.rank,
            bucket_s=g.bucket_s,
            ts=[float(t) for t in g.ts.tolist()],
            gpu_index=None if g.gpu_index is None else ints(g.gpu_index),
            num_devices=ints(g.num_devices),
            values={name: floats(v) for name, v in g.values.items()},
            throttle_reasons=ints(g.throttle_reasons),
        )


class DifferenceRead(BaseModel):
    """One figure of both jobs: candidate − baseline and candidate / baseline − 1."""

    model_config = ConfigDict(from_attributes=True)

    name: str
    baseline: float | None
    candidate: float | None
    difference: float | None
    relative: float | None
    higher_is_better: bool | None

    @classmethod
    def of(cls, d: query.Difference) -> DifferenceRead:
        return cls.model_validate(d)


class ComponentDifferenceRead(BaseModel):
    """A time component: its share of the ranks' step time and its seconds per step."""

    model_config = ConfigDict(from_attributes=True)

    component: str
    share: DifferenceRead
    seconds: DifferenceRead


class ComparisonRead(BaseModel):
    """A candidate job against a baseline: both summaries and the differences."""

    model_config = ConfigDict(from_attributes=True)

    baseline: JobSummaryRead
    candidate: JobSummaryRead
    same_benchmark_key: bool
    metrics: list[DifferenceRead]
    components: list[ComponentDifferenceRead]

    @classmethod
    def of(cls, c: query.Comparison) -> ComparisonRead:
        return cls.model_validate(c)


class DeletedRead(BaseModel):
    """What deleting a job removed: rows per table."""

    job_id: str
    deleted_rows: dict[str, int]


class IngestResultRead(BaseModel):
    """An ingested batch: rows stored per section, and whether it was a resend."""

    accepted: dict[str, int] = Field(description="rows stored per section")
    duplicate: bool


class IngestBundleItemRead(BaseModel):
    """One batch of a node's bundle: stored (200, as IngestResultRead) or rejected alone (4xx,
    with the detail it would get on its own)."""

    status: int = Field(description="the HTTP status of this batch: 200, or a 4xx")
    accepted: dict[str, int] | None = Field(None, description="rows stored per section")
    duplicate: bool | None = None
    detail: str | None = Field(None, description="what is wrong with the batch")


class IngestBundleResultRead(BaseModel):
    """A node's bundle: one result per batch, in the order of the bundle."""

    results: list[IngestBundleItemRead]
