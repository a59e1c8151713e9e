"""The canonical record schema (DESIGN §2): column names, dtypes, units. Stdlib only.

These names are a public contract shared by the wire format, the database, parquet
exports and offline analysis. Every other module reads its column lists from here.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

WIRE_SCHEMA_VERSION = 1
MAX_ID_CHARS = 256
MAX_DURATION_S = 7 * 86_400.0
"""Longest duration a record may hold (a step, a section, a collective's busy time), in
seconds: anything longer is a broken clock, refused with a 422 that names the column."""
MAX_EPOCH_S = 2.0**32
"""Timestamps are Unix epoch seconds from 1970 to 2106; others are refused (422)."""
DROP_REPORT_PREFIX = "stepscope dropped "
"""The message of a profiler's `custom` event that reports records it dropped; its attributes
count them by kind (`dropped_steps`, `dropped_collectives`, `dropped_gpu`, `dropped_events`)."""
"""Longest job id, node name or incarnation id the wire protocol and the API accept."""

Dtype = Literal["str", "int", "float", "json"]


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    dtype: Dtype
    required: bool = False
    unit: str = ""
    doc: str = ""


@dataclass(frozen=True, slots=True)
class Table:
    name: str
    key: tuple[str, ...]
    """Natural key: rows are unique by these columns."""
    columns: tuple[Column, ...]
    wire_excluded: tuple[str, ...] = ()
    """Columns a wire batch does not carry per row (they come from `job` and `source`)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.required)

    @property
    def wire_columns(self) -> tuple[Column, ...]:
        return tuple(c for c in self.columns if c.name not in self.wire_excluded)

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"{self.name} has no column {name!r}")


def _c(name: str, dtype: Dtype, unit: str = "", doc: str = "", *, required: bool = False) -> Column:
    return Column(name=name, dtype=dtype, required=required, unit=unit, doc=doc)


StepRule = Literal["optimizer", "dataloader", "lightning", "transformers", "torchtitan"]
STEP_RULES: tuple[StepRule, ...] = get_args(StepRule)
"""What marks a step when the user's code does not call step(): zero-code's rules (one step per
optimizer update; per data-loader batch in a job with no optimizer) or a framework adapter."""

STEPS = Table(
    name="steps",
    key=("job_id", "rank", "step"),
    wire_excluded=("job_id", "rank", "node"),
    columns=(
        _c("job_id", "str", doc="job identifier", required=True),
        _c("rank", "int", doc="global rank", required=True),
        _c("step", "int", doc="training step (iteration) number", required=True),
        _c("ts", "float", "s", "step start, Unix epoch seconds", required=True),
        _c("step_s", "float", "s", "wall time of the whole step on this rank", required=True),
        _c("data_s", "float", "s", "time blocked waiting for the next batch", required=True),
        _c("h2d_s", "float", "s", "host-to-device copy time"),
        _c("forward_s", "float", "s", "forward section time"),
        _c("backward_s", "float", "s", "backward section time"),
        _c("optimizer_s", "float", "s", "optimizer section time"),
        _c("comm_s", "float", "s", "total time collectives were in flight during the step"),
        _c("comm_wait_s", "float", "s", "time blocked on collectives, not overlapped by own work"),
        _c("compute_s", "float", "s", "step_s - data_s - comm_wait_s"),
        _c("tokens", "int", doc="tokens processed by this rank in this step"),
        _c("samples", "int", doc="samples processed by this rank in this step"),
        _c("flops", "float", "FLOP", "model FLOPs executed by this rank in this step"),
        _c("mem_peak_bytes", "int", "bytes", "peak device memory allocated in this step"),
        _c("step_rule", "str", doc="what marked the step (STEP_RULES); null: the user's step()"),
        _c("node", "str", doc="host name; in files only (the store keeps it per rank)"),
    ),
)

COLLECTIVE_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "send",
    "recv",
    "barrier",
)

DEFAULT_GROUP = ""
"""`group` of collectives rows whose process group is not known (files and profilers older
than per-group records)."""

COLLECTIVES = Table(
    name="collectives",
    key=("job_id", "rank", "step", "group", "op"),
    wire_excluded=("job_id", "rank"),
    columns=(
        _c("job_id", "str", required=True),
        _c("rank", "int", required=True),
        _c("step", "int", required=True),
        _c("group", "str", doc="process group name (pg.group_name; the same on every member)"),
        _c("op", "str", doc="one of COLLECTIVE_OPS", required=True),
        _c("group_size", "int", doc="ranks in the process group", required=True),
        _c("count", "int", doc="collectives of this op in the step", required=True),
        _c("bytes", "int", "bytes", "payload per rank, summed over the step", required=True),
        _c("busy_s", "float", "s", "durations summed over the step", required=True),
        _c("wait_s", "float", "s", "time the training thread sat blocked on these calls"),
        _c("first_seq", "int", doc="per-group sequence number of the step's first call of op"),
        _c("mesh_dim", "str", doc="DeviceMesh dimension the group spans (tp, dp_shard, pp, ...)"),
        _c("group_ranks", "str", doc="members, compact: 0-3, 0-6:2, 0,1,5 or h:<hash>"),
    ),
)
"""One row per (step, process group, op) of a rank. `group` is optional on the wire and in
files (DEFAULT_GROUP when absent); the store keeps it non-null as part of the key."""

GPU = Table(
    name="gpu_samples",
    key=("job_id", "rank", "gpu_index", "ts"),
    wire_excluded=("job_id", "rank"),
    columns=(
        _c("job_id", "str", required=True),
        _c("rank", "int", required=True),
        _c("ts", "float", "s", "sample time, Unix epoch seconds", required=True),
        _c("gpu_index", "int", doc="device index on the host", required=True),
        _c("util", "float", "%", "GPU utilisation"),
        _c("mem_used_bytes", "int", "bytes"),
        _c("mem_total_bytes", "int", "bytes"),
        _c("power_w", "float", "W"),
        _c("temp_c", "float", "°C"),
        _c("sm_clock_mhz", "float", "MHz"),
        _c("throttle_reasons", "int", doc="NVML clocks-event reasons bitmask"),
        _c("sm_active", "float", "%", "GPM SM activity"),
        _c("tensor_active", "float", "%", "GPM tensor-core activity"),
        _c("dram_active", "float", "%", "GPM DRAM bandwidth utilisation"),
        _c("nvlink_tx_bps", "float", "B/s"),
        _c("nvlink_rx_bps", "float", "B/s"),
        _c("pcie_tx_bps", "float", "B/s"),
        _c("pcie_rx_bps", "float", "B/s"),
    ),
)

EVENT_KINDS = (
    "xid",
    "ecc",
    "oom",
    "restart",
    "exception",
    "custom",
    "start",
    "resume",
    "phase",
    "exit",
)
"""start, resume, phase and exit are a process's lifecycle (docs/goodput.md): start at the
process's start time, resume at its first step, a declared phase at its start, exit at close."""

LIFECYCLE_ATTRIBUTES: dict[str, dict[str, tuple[Dtype, bool]]] = {
    "start": {
        "incarnation": ("str", True),
        "restart_count": ("int", False),
        "submitted_at": ("float", False),
        "scheduled_at": ("float", False),
        "init_at": ("float", False),
    },
    "resume": {"incarnation": ("str", True), "step": ("int", True), "resumed_from": ("int", False)},
    "phase": {"incarnation": ("str", True), "name": ("str", True), "duration_s": ("float", True)},
    "exit": {"incarnation": ("str", True), "failed": ("int", False)},
}
"""Per lifecycle event kind, its attributes: name → (dtype, required); the collector rejects
a batch whose lifecycle event lacks one or carries a wrong type (other attributes are free)."""

GoodputCategory = Literal[
    "productive",
    "startup",
    "compile",
    "checkpoint_save",
    "checkpoint_load",
    "eval",
    "other_phase",
    "data",
    "exposed_comm",
    "straggler_wait",
    "hang",
    "restart_downtime",
    "lost_progress",
    "unaccounted",
]
"""Where a GPU-second of a job went (docs/goodput.md): productive, or one named badput."""
GOODPUT_CATEGORIES: tuple[GoodputCategory, ...] = get_args(GoodputCategory)
GOODPUT_METRICS: tuple[str, ...] = ("goodput", *(f"badput_{c}" for c in GOODPUT_CATEGORIES[1:]))
"""The CI gate's metrics on a job's GPU-time: the productive share (goodput), and each
badput category's share (badput_hang, badput_restart_downtime, ...)."""

EVENTS = Table(
    name="events",
    key=("job_id", "rank", "ts", "kind"),
    wire_excluded=("job_id", "rank"),
    columns=(
        _c("job_id", "str", required=True),
        _c("rank", "int", required=True),
        _c("ts", "float", "s", required=True),
        _c("kind", "str", doc="one of EVENT_KINDS", required=True),
        _c("message", "str"),
        _c("attributes", "json"),
    ),
)

JOBS = Table(
    name="jobs",
    key=("job_id",),
    columns=(
        _c("job_id", "str", required=True),
        _c("name", "str"),
        _c("benchmark_key", "str", doc="what makes two jobs comparable"),
        _c("world_size", "int"),
        _c("device_name", "str"),
        _c("peak_flops", "float", "FLOP/s", "peak per device"),
        _c("started_at", "float", "s"),
        _c("ended_at", "float", "s"),
        _c("status", "str"),
        _c("attributes", "json"),
    ),
)

RANKS = Table(
    name="ranks",
    key=("job_id", "rank"),
    columns=(
        _c("job_id", "str", required=True),
        _c("rank", "int", required=True),
        _c("local_rank", "int"),
        _c("node", "str"),
        _c("pid", "int"),
        _c("incarnation", "str", doc="latest process incarnation seen for this rank"),
        _c("mesh", "json", doc="DeviceMesh coordinates: {dim: [coordinate, size]} (pp: stage)"),
        _c(
            "attributes",
            "json",
            doc="where the rank ran: scheduler names (k8s.pod.name, slurm...), gpu.uuid",
        ),
        _c("first_seen", "float", "s"),
        _c("last_seen", "float", "s"),
    ),
)

FindingKind = Literal[
    "straggler_rank",
    "straggler_node",
    "dataloader_stall",
    "slow_collective",
    "gpu_throttling",
    "throughput_drop",
    "throughput_gain",
    "mfu_low",
    "peak_unknown",
    "hang",
]
Severity = Literal["info", "warning", "critical"]
Cause = Literal["data", "compute", "communication", "gpu_throttling", "host", "unknown"]
Component = Literal["step_s", "data_s", "compute_s", "comm_wait_s", "collective_finish_s"]
"""A part of the step time a finding or a chart names (a straggler's evidence["component"])."""
HangClass = Literal["never_entered", "mismatched", "not_completing", "silent"]
"""How a hang came about (a hang finding's evidence["class"])."""
FINDING_KINDS: tuple[FindingKind, ...] = get_args(FindingKind)
HANG_CLASSES: tuple[HangClass, ...] = get_args(HangClass)
SEVERITIES: tuple[Severity, ...] = get_args(Severity)
CAUSES: tuple[Cause, ...] = get_args(Cause)
COMPONENTS: tuple[Component, ...] = get_args(Component)
CaptureStatus = Literal["requested", "delivered", "uploaded", "failed"]
"""Where one rank's deep capture (#21) is: asked for, told to the rank in an ingest answer,
its trace stored, or given up by the rank (the error says why)."""
CaptureRole = Literal["culprit", "reference"]
"""The rank a finding or a user names, or the healthy rank recorded beside it."""
CAPTURE_STATUSES: tuple[CaptureStatus, ...] = get_args(CaptureStatus)
CAPTURE_ROLES: tuple[CaptureRole, ...] = get_args(CaptureRole)
Scope = Literal["ingest", "read", "admin"]
"""What a bearer token allows: send batches, read jobs, or everything (admin)."""
SCOPES: tuple[Scope, ...] = get_args(Scope)

FINDINGS = Table(
    name="findings",
    key=("job_id", "kind", "ranks", "first_step", "metric"),
    columns=(
        _c("job_id", "str", required=True),
        _c("kind", "str", doc="one of FINDING_KINDS", required=True),
        _c("severity", "str", doc="one of SEVERITIES", required=True),
        _c("ranks", "json", doc="list of ranks concerned"),
        _c("node", "str"),
        _c("first_step", "int"),
        _c("last_step", "int"),
        _c("metric", "str"),
        _c("expected", "float"),
        _c("observed", "float"),
        _c("effect", "float", doc="relative change, signed (observed / expected - 1)"),
        _c("cause", "str", doc="one of CAUSES"),
        _c("evidence", "json"),
        _c("detected_at", "float", "s"),
    ),
)

TABLES: dict[str, Table] = {
    t.name: t for t in (STEPS, COLLECTIVES, GPU, EVENTS, JOBS, RANKS, FINDINGS)
}


@dataclass(kw_only=True, slots=True)
class Finding:
    """One conclusion of the analysis, with the columns of the `findings` table."""

    job_id: str
    kind: FindingKind
    severity: Severity
    ranks: list[int] = field(default_factory=list)
    node: str | None = None
    first_step: int | None = None
    last_step: int | None = None
    metric: str | None = None
    expected: float | None = None
    observed: float | None = None
    effect: float | None = None
    cause: Cause | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    detected_at: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in FINDING_KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_BUSBW_FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def busbw_factor(op: str, group_size: int) -> float:
    """nccl-tests bus-bandwidth factor for `op` over `group_size` ranks (1 for point-to-point)."""
    if op not in COLLECTIVE_OPS:
        raise ValueError(f"unknown collective op {op!r}")
    if op == "barrier":
        return 0.0
    factor = _BUSBW_FACTORS.get(op)
    return factor(group_size) if factor and group_size > 0 else 1.0


def busbw_bps(op: str, group_size: int, num_bytes: float, seconds: float) -> float:
    """Bus bandwidth in bytes/s (algbw × factor); NaN when the duration is not positive."""
    if seconds <= 0:
        return math.nan
    return num_bytes / seconds * busbw_factor(op, group_size)


def group_label(group: str | None, mesh_dim: str | None) -> str:
    """What a process group is called in findings, charts and rollups: its mesh dimension
    when it spans one (every tp group is "tp"), else "group <name>" ("all" when unknown)."""
    if mesh_dim:
        return mesh_dim
    if not group:
        return "all"
    return f"group {group}"


def compact_ranks(ranks: list[int] | tuple[int, ...]) -> str:
    """A group's members in a few characters: "0-3", "0-6:2" (every 2nd), "0,1,5", or
    "h:<12 hex>" for an irregular group of more than 16 ranks."""
    members = sorted(ranks)
    if not members:
        return ""
    if len(members) == 1:
        return str(members[0])
    stride = members[1] - members[0]
    if stride > 0 and all(b - a == stride for a, b in zip(members, members[1:], strict=False)):
        span = f"{members[0]}-{members[-1]}"
        return span if stride == 1 else f"{span}:{stride}"
    if len(members) <= 16:
        return ",".join(map(str, members))
    digest = hashlib.sha1(",".join(map(str, members)).encode(), usedforsecurity=False)
    return f"h:{digest.hexdigest()[:12]}"


def expand_ranks(compact: str) -> list[int] | None:
    """The members `compact_ranks` wrote (None for a hashed group)."""
    if not compact or compact.startswith("h:"):
        return None
    if "-" in compact:
        span, _, stride = compact.partition(":")
        first, last = (int(x) for x in span.split("-"))
        return list(range(first, last + 1, int(stride or 1)))
    return [int(x) for x in compact.split(",")]
