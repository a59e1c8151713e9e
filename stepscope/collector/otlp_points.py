"""OTLP metric points, flattened, placed in a job and rank, and turned into table rows.

GPU telemetry (the OTel `hw.gpu.*` conventions and dcgm-exporter's `DCGM_FI_*` names)
becomes `gpu_samples` rows; every other gauge, sum and histogram an `otlp_metrics` row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

_MIB = 1024 * 1024
GPU_METRICS: dict[str, tuple[str, float]] = {
    # OpenTelemetry semantic conventions (hw.gpu.*): ratios become percent.
    "hw.gpu.utilization": ("util", 100.0),
    "hw.gpu.memory.usage": ("mem_used_bytes", 1.0),
    "hw.gpu.memory.limit": ("mem_total_bytes", 1.0),
    # dcgm-exporter's field names, as an OpenTelemetry Collector relays them.
    "DCGM_FI_DEV_GPU_UTIL": ("util", 1.0),
    "DCGM_FI_DEV_FB_USED": ("mem_used_bytes", _MIB),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", 1.0),
    "DCGM_FI_DEV_GPU_TEMP": ("temp_c", 1.0),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", 1.0),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": ("throttle_reasons", 1.0),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": ("throttle_reasons", 1.0),
    "DCGM_FI_PROF_SM_ACTIVE": ("sm_active", 100.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("tensor_active", 100.0),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("dram_active", 100.0),
    "DCGM_FI_PROF_PCIE_TX_BYTES": ("pcie_tx_bps", 1.0),
    "DCGM_FI_PROF_PCIE_RX_BYTES": ("pcie_rx_bps", 1.0),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": ("nvlink_tx_bps", 1.0),
    "DCGM_FI_PROF_NVLINK_RX_BYTES": ("nvlink_rx_bps", 1.0),
}
"""Metric name → (gpu_samples column, factor to its unit)."""
_HW_GPU_METRICS = {"hw.power": "power_w", "hw.temperature": "temp_c"}
"""Generic hardware metrics that are GPU telemetry when `hw.type` is "gpu"."""
SAMPLE_WINDOW_S = 0.5
"""GPU points of one device this close in time (in one request) form one sample."""
_INT_COLUMNS = frozenset({"mem_used_bytes", "mem_total_bytes", "throttle_reasons"})

JOB_KEYS = ("stepscope.job_id", "job.id")
RANK_KEYS = ("stepscope.rank", "rank")
HOST_KEYS = ("k8s.pod.name", "host.name", "k8s.node.name", "Hostname")
"""Attributes that name where a point came from, tried in this order against the names the
ranks reported (their node, pod and host names)."""
RANK_NAME_KEYS = ("k8s.pod.name", "host.name", "k8s.node.name")
"""A rank's attributes that name where it ran, besides its node."""
GPU_INDEX_KEYS = ("gpu_index", "gpu", "hw.gpu.index")
GPU_UUID_KEYS = ("gpu.uuid", "UUID")
"""A GPU point's device UUID (dcgm-exporter's `UUID`), matched against the NVML UUID a rank
sent (its `gpu.uuid` attribute)."""
_PLACEMENT_KEYS = frozenset({*JOB_KEYS, *RANK_KEYS})


@dataclass(frozen=True, slots=True)
class Point:
    """One data point with its metric's name, kind and unit, and all its attributes."""

    name: str
    kind: str
    unit: str
    ts: float
    attributes: dict[str, Any]
    """Resource attributes overlaid by the point's own."""
    point_attributes: dict[str, Any]
    value: float | None = None
    count: int | None = None
    minimum: float | None = None
    maximum: float | None = None
    bounds: list[float] | None = None
    bucket_counts: list[int] | None = None


@dataclass(slots=True)
class Flattened:
    points: list[Point] = field(default_factory=list)
    num_unsupported: int = 0
    """Points of kinds stepscope does not store (exponential histograms, summaries)."""


def _any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(value, kind)
    return None


def attributes(pairs: Iterator[KeyValue] | Any) -> dict[str, Any]:
    """OTLP key-values as a dict of scalars (arrays, maps and bytes are left out)."""
    found = {kv.key: _any_value(kv.value) for kv in pairs}
    return {k: v for k, v in found.items() if v is not None}


def flatten(request: ExportMetricsServiceRequest) -> Flattened:
    """Every gauge, sum and histogram point of a request."""
    out = Flattened()
    for resource_metrics in request.resource_metrics:
        resource = attributes(resource_metrics.resource.attributes)
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                if kind in ("gauge", "sum"):
                    for dp in getattr(metric, kind).data_points:
                        own = attributes(dp.attributes)
                        number = dp.as_double if dp.WhichOneof("value") == "as_double" else None
                        value = float(dp.as_int) if number is None else number
                        out.points.append(
                            Point(
                                metric.name,
                                kind,
                                metric.unit,
                                dp.time_unix_nano / 1e9,
                                {**resource, **own},
                                own,
                                value=value,
                            )
                        )
                elif kind == "histogram":
                    for hp in metric.histogram.data_points:
                        own = attributes(hp.attributes)
                        out.points.append(
                            Point(
                                metric.name,
                                kind,
                                metric.unit,
                                hp.time_unix_nano / 1e9,
                                {**resource, **own},
                                own,
                                value=hp.sum if hp.HasField("sum") else None,
                                count=int(hp.count),
                                minimum=hp.min if hp.HasField("min") else None,
                                maximum=hp.max if hp.HasField("max") else None,
                                bounds=list(hp.explicit_bounds),
                                bucket_counts=[int(c) for c in hp.bucket_counts],
                            )
                        )
                elif kind is not None:
                    data = getattr(metric, kind)
                    out.num_unsupported += len(data.data_points)
    return out


def gpu_column(point: Point) -> tuple[str, float] | None:
    """The gpu_samples column a point fills and the factor to its unit; None if not GPU."""
    found = GPU_METRICS.get(point.name)
    if found is not None:
        return found
    column = _HW_GPU_METRICS.get(point.name)
    if column is not None and point.attributes.get("hw.type") == "gpu":
        return column, 1.0
    return None


def first(attrs: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The value of the first of `keys` that `attrs` has."""
    return next((attrs[k] for k in keys if k in attrs), None)


def as_int(value: Any) -> int | None:
    """An attribute as a non-negative int (OTLP senders often send numbers as strings)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and value >= 0:
        return value
    return None


@dataclass(frozen=True, slots=True)
class RankOnNode:
    job_id: str
    rank: int
    local_rank: int | None
    gpu_uuid: str | None = None


NodeLookup = Callable[[set[str], str | None], dict[str, list[RankOnNode]]]
"""Host names (and a job, if known) → the ranks that reported from each host."""


def place(
    points: list[Point], lookup: NodeLookup
) -> tuple[dict[tuple[str, int], list[Point]], list[Point]]:
    """Points by (job, rank), and those no attribute placed.

    A point names its job and rank, or its job and host, or only its host. On its host, a GPU
    point goes to the rank whose GPU has the point's UUID (whichever job it belongs to), else
    to the rank whose local rank is the point's GPU index; a host's only rank takes every
    point, and a non-GPU point goes to the host's lowest rank.
    """
    placed: dict[tuple[str, int], list[Point]] = {}
    pending: list[tuple[Point, str | None, list[str]]] = []
    unplaced: list[Point] = []
    for point in points:
        job_id = first(point.attributes, JOB_KEYS)
        job_id = str(job_id) if job_id not in (None, "") else None
        rank = as_int(first(point.attributes, RANK_KEYS))
        if job_id is not None and rank is not None:
            placed.setdefault((job_id, rank), []).append(point)
            continue
        hosts = [str(point.attributes[k]) for k in HOST_KEYS if point.attributes.get(k)]
        if hosts:
            pending.append((point, job_id, hosts))
        else:
            unplaced.append(point)
    by_job: dict[str | None, set[str]] = {}
    for _point, job_id, hosts in pending:
        by_job.setdefault(job_id, set()).update(hosts)
    ranks = {job_id: lookup(hosts, job_id) for job_id, hosts in by_job.items()}
    for point, job_id, hosts in pending:
        # The first name that some rank reported from places the point.
        on_host = next((ranks[job_id][h] for h in hosts if h in ranks[job_id]), [])
        chosen = _rank_on_host(on_host, point)
        if chosen is None:
            unplaced.append(point)
        else:
            placed.setdefault((chosen.job_id, chosen.rank), []).append(point)
    return placed, unplaced


def _rank_on_host(candidates: list[RankOnNode], point: Point) -> RankOnNode | None:
    uuid = first(point.attributes, GPU_UUID_KEYS)
    if uuid and gpu_column(point) is not None:
        owners = [c for c in candidates if c.gpu_uuid == str(uuid)]
        if len(owners) == 1:
            return owners[0]  # even on a host that two jobs share
    if len({c.job_id for c in candidates}) != 1:
        return None  # no job on that host, or several: ambiguous
    if len(candidates) == 1:
        return candidates[0]
    gpu = as_int(first(point.attributes, GPU_INDEX_KEYS))
    if gpu_column(point) is not None:
        return next((c for c in candidates if c.local_rank == gpu), None)
    return min(candidates, key=lambda c: c.rank)


def gpu_rows(job_id: str, rank: int, points: list[Point]) -> dict[str, list[Any]]:
    """gpu_samples columns from a rank's GPU points, one row per (device, time)."""
    rows: dict[tuple[int, float], dict[str, Any]] = {}
    open_rows: dict[int, tuple[float, dict[str, Any]]] = {}
    for point in sorted(points, key=lambda p: p.ts):
        column, factor = gpu_column(point) or ("", 1.0)
        if point.value is None:
            continue
        gpu_index = as_int(first(point.attributes, GPU_INDEX_KEYS)) or 0
        value = point.value * factor
        # An SDK stamps each instrument's points at its own collection: one device's points
        # a moment apart are one sample (at the first one's time), unless a column repeats.
        start = open_rows.get(gpu_index)
        if start is None or point.ts - start[0] > SAMPLE_WINDOW_S or column in start[1]:
            start = (point.ts, rows.setdefault((gpu_index, point.ts), {}))
            open_rows[gpu_index] = start
        start[1][column] = int(round(value)) if column in _INT_COLUMNS else value
    columns: dict[str, list[Any]] = {"job_id": [], "rank": [], "ts": [], "gpu_index": []}
    names = sorted({c for row in rows.values() for c in row})
    for name in names:
        columns[name] = []
    for (gpu_index, ts), row in rows.items():
        columns["job_id"].append(job_id)
        columns["rank"].append(rank)
        columns["ts"].append(ts)
        columns["gpu_index"].append(gpu_index)
        for name in names:
            columns[name].append(row.get(name))
    return columns


def _json(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def metric_rows(job_id: str, rank: int, points: list[Point]) -> dict[str, list[Any]]:
    """otlp_metrics columns from a rank's other points (JSON columns as text)."""
    rows = {
        (
            p.name,
            orjson.dumps(
                {k: v for k, v in p.point_attributes.items() if k not in _PLACEMENT_KEYS},
                option=orjson.OPT_SORT_KEYS,
            ).decode(),
            p.ts,
        ): p
        for p in points
    }  # one row per key: a repeated point keeps the last
    columns: dict[str, list[Any]] = {
        name: []
        for name in (
            "job_id",
            "rank",
            "name",
            "series",
            "ts",
            "kind",
            "unit",
            "value",
            "count",
            "min",
            "max",
            "bounds",
            "bucket_counts",
        )
    }
    for (name, series, ts), p in rows.items():
        for column, value in (
            ("job_id", job_id),
            ("rank", rank),
            ("name", name),
            ("series", series),
            ("ts", ts),
            ("kind", p.kind),
            ("unit", p.unit or None),
            ("value", p.value),
            ("count", p.count),
            ("min", p.minimum),
            ("max", p.maximum),
            ("bounds", _json(p.bounds)),
            ("bucket_counts", _json(p.bucket_counts)),
        ):
            columns[column].append(value)
    return columns


def is_finite(point: Point) -> bool:
    """False for a point without a time, or with a NaN or infinite value (the store keeps
    finite numbers only)."""
    return point.ts > 0 and all(
        v is None or math.isfinite(v) for v in (point.value, point.minimum, point.maximum)
    )
