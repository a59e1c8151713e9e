"""One training step as the profiler saw it, and how it becomes wire rows.

A `StepRecord` collects marks on the hot path; `is_resolved()` asks (without blocking)
whether every mark has happened; `to_rows()` turns it into one schema.STEPS row and
schema.COLLECTIVES rows aggregated per process group and op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stepscope.profiler.collectives.calls import CollectiveCall
from stepscope.profiler.timer import Clock, Mark, union_s

SECTION_COLUMNS = {
    "forward": "forward_s",
    "backward": "backward_s",
    "optimizer": "optimizer_s",
    "h2d": "h2d_s",
}
"""Section names that map to schema.STEPS columns."""

_DURATION_SCALE = 1e7
"""Durations go on the wire to 0.1 µs, as round(s * 1e7) / 1e7: the float round(s, 7) gives
(but at exact ties of the eighth digit) at half its cost, ~11 roundings a step."""
_TS_SCALE = 1e6


@dataclass(slots=True)
class StepRecord:
    """Marks and values of one step on this rank."""

    step: int
    ts: float
    """Step start (first dataloader wait before it, or step() entry), epoch seconds."""
    base: Mark
    """Clock mark at step() entry; the origin for this step's device-side offsets."""
    data_s: float = 0.0
    step_s: float = 0.0
    spans: list[tuple[str, Mark, Mark]] = field(default_factory=list)
    """Each section's (name, start, end), in the order they ended; a name may repeat."""
    calls: list[CollectiveCall] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    """Column values given directly: tokens, samples, flops, mem_peak_bytes..."""
    custom: dict[str, Any] = field(default_factory=dict)
    """Values with no column (prof.record(**custom), unknown section names)."""

    def is_resolved(self, clock: Clock) -> bool:
        """Every mark has happened and every collective completed (never blocks)."""
        on_cpu = clock.name == "cpu"  # every mark is ready: only a collective may be in flight
        for call in self.calls:
            if call.end is None or not (on_cpu or clock.is_ready(call.end)):
                return False
        if on_cpu:
            return True
        for _, _, end in self.spans:
            if not clock.is_ready(end):
                return False
        return True

    def to_rows(
        self, clock: Clock, mesh_dims: dict[str, str]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The steps row and the collectives rows of this step; unresolved marks are skipped.

        `mesh_dims` labels groups (by name) with the mesh dimension they span."""
        # Runs once per step (on the shipper thread): plain loops, no helper calls per value.
        ready = clock.is_ready
        between = clock.seconds_between
        scale = _DURATION_SCALE
        row: dict[str, Any] = {
            "step": self.step,
            "ts": round(self.ts * _TS_SCALE) / _TS_SCALE,
            "step_s": round(self.step_s * scale) / scale,
            "data_s": round(self.data_s * scale) / scale,
        }
        sections_s: dict[str, float] = {}
        on_cpu = clock.name == "cpu"  # perf_counter readings, all ready: no call per mark
        for name, start, end in self.spans:
            if on_cpu:
                span_s = end - start
            else:
                span_s = between(start, end) if ready(end) else 0.0
            sections_s[name] = sections_s.get(name, 0.0) + span_s
        for name, total_s in sections_s.items():
            column = SECTION_COLUMNS.get(name)
            if column is not None:
                row[column] = round(total_s * scale) / scale
            else:
                self.custom[f"{name}_s"] = round(total_s * scale) / scale
        comm_wait_s = 0.0
        collective_rows: list[dict[str, Any]] = []
        if self.calls:
            comm_s, comm_wait_s, collective_rows = _collectives(
                self.step, self.calls, self.base, clock, mesh_dims
            )
            if collective_rows:
                row["comm_s"] = round(comm_s * scale) / scale
                row["comm_wait_s"] = round(comm_wait_s * scale) / scale
        compute_s = max(0.0, self.step_s - self.data_s - comm_wait_s)
        row["compute_s"] = round(compute_s * scale) / scale
        row.update(self.values)
        return row, collective_rows


def _collectives(
    step: int, calls: list[CollectiveCall], base: Mark, clock: Clock, mesh_dims: dict[str, str]
) -> tuple[float, float, list[dict[str, Any]]]:
    """The step's completed collectives, in one pass: the time any was in flight (comm_s), the
    time this rank sat blocked on them (comm_wait_s), and one row per (group, op).

    Blocked: for DDP's buckets, from the last bucket becoming ready (the end of this rank's
    gradient compute) to the last bucket's all-reduce completing, which goes to the row of
    its all-reduces. A rank delayed in backward has its last bucket ready late and waits
    least; its peers wait for it. For every other collective, the spans the training thread
    sat in its wait.
    """
    on_cpu = clock.name == "cpu"
    ready = clock.is_ready
    between = clock.seconds_between
    in_flight: list[tuple[float, float]] = []
    # (group, op) → [a call, count, bytes, busy_s, wait_s, first_seq]
    by_key: dict[tuple[str, str], list[Any]] = {}
    waited_s = 0.0
    ddp_key: tuple[str, str] | None = None
    last_ready_s = last_done_s = 0.0
    for call in calls:
        end = call.end
        if end is None:
            continue
        if on_cpu:  # perf_counter readings, all ready: arithmetic, no call per mark
            start_s, end_s = call.start - base, end - base
            wait_s = call.wait_s
        elif ready(end):
            start_s, end_s = between(base, call.start), between(base, end)
            wait_s = _waited_s(call.waits, clock) if call.waits else 0.0
        else:
            continue
        in_flight.append((start_s, end_s))
        key = (call.group.name, call.op)
        if call.ddp_bucket:
            if ddp_key is None:
                ddp_key, last_ready_s, last_done_s = key, start_s, end_s
            else:
                last_ready_s, last_done_s = max(last_ready_s, start_s), max(last_done_s, end_s)
            wait_s = 0.0
        waited_s += wait_s
        busy_s = max(0.0, end_s - start_s)
        agg = by_key.get(key)
        if agg is None:
            by_key[key] = [call, call.count, call.num_bytes, busy_s, wait_s, call.seq]
        else:
            agg[1] += call.count
            agg[2] += call.num_bytes
            agg[3] += busy_s
            agg[4] += wait_s
            if agg[5] is None or (call.seq is not None and call.seq < agg[5]):
                agg[5] = call.seq
    if ddp_key is not None:
        ddp_s = max(0.0, last_done_s - last_ready_s)
        by_key[ddp_key][4] += ddp_s
        waited_s += ddp_s
    scale = _DURATION_SCALE
    rows = [
        {
            "step": step,
            "group": call.group.name,
            "op": call.op,
            "group_size": call.group.size,
            "count": count,
            "bytes": num_bytes,
            "busy_s": round(busy_s * scale) / scale,
            "wait_s": round(wait_s * scale) / scale,
            "first_seq": first_seq,
            "mesh_dim": mesh_dims.get(call.group.name),
            "group_ranks": call.group.ranks,
        }
        for call, count, num_bytes, busy_s, wait_s, first_seq in by_key.values()
    ]
    return union_s(in_flight), waited_s, rows


def _waited_s(waits: list[tuple[Mark, Mark]], clock: Clock) -> float:
    total_s = 0.0
    for start, end in waits:
        if clock.is_ready(end):
            total_s += max(0.0, clock.seconds_between(start, end))
    return total_s
