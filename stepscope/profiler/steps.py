"""One training step as the profiler saw it, and how it becomes wire rows.

A `StepRecord` collects marks on the hot path; `is_resolved()` asks (without blocking)
whether every mark has happened; `to_rows()` turns it into one schema.STEPS row and
schema.COLLECTIVES rows aggregated per process group and op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .calls import CollectiveCall
from .timer import Clock, Mark, union_s

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
        for call in self.calls:
            if call.end is None or not clock.is_ready(call.end):
                return False
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
        for name, start, end in self.spans:
            span_s = between(start, end) if ready(end) else 0.0
            sections_s[name] = sections_s.get(name, 0.0) + span_s
        for name, total_s in sections_s.items():
            column = SECTION_COLUMNS.get(name)
            if column is not None:
                row[column] = round(total_s * scale) / scale
            else:
                self.custom[f"{name}_s"] = round(total_s * scale) / scale
        comm_wait_s = ddp_wait_s = 0.0
        done: list[CollectiveCall] = []
        if self.calls:
            done = [c for c in self.calls if c.end is not None and ready(c.end)]
        if done:
            # Each call's offsets from the step's start and exposed wait, computed once.
            times_s = [
                (
                    between(self.base, c.start),
                    between(self.base, c.end),
                    _waited_s(c.waits, clock) if c.waits else 0.0,
                )
                for c in done
            ]
            row["comm_s"] = round(union_s([(s, e) for s, e, _ in times_s]) * scale) / scale
            comm_wait_s, ddp_wait_s = _comm_wait_s(done, times_s)
            row["comm_wait_s"] = round(comm_wait_s * scale) / scale
        compute_s = max(0.0, self.step_s - self.data_s - comm_wait_s)
        row["compute_s"] = round(compute_s * scale) / scale
        row.update(self.values)
        if not done:
            return row, []
        return row, _collective_rows(self.step, done, times_s, mesh_dims, ddp_wait_s)


def _comm_wait_s(
    calls: list[CollectiveCall], times_s: list[tuple[float, float, float]]
) -> tuple[float, float]:
    """Time this rank sat blocked on collectives, not overlapped by its own work (and the
    part of it that was DDP's).

    DDP buckets: from the last bucket becoming ready (the end of this rank's gradient
    compute) to the last bucket's all-reduce completing. A rank delayed in backward has
    its last bucket ready late and waits least; its peers wait for it. Every other
    collective: the spans the training thread sat in its wait.
    """
    wait_s = 0.0
    last_ready_s = last_done_s = None
    for call, (start_s, end_s, call_wait_s) in zip(calls, times_s, strict=True):
        if call.ddp_bucket:
            last_ready_s = start_s if last_ready_s is None else max(last_ready_s, start_s)
            last_done_s = end_s if last_done_s is None else max(last_done_s, end_s)
        else:
            wait_s += call_wait_s
    ddp_s = 0.0
    if last_ready_s is not None and last_done_s is not None:
        ddp_s = max(0.0, last_done_s - last_ready_s)
    return wait_s + ddp_s, ddp_s


def _waited_s(waits: list[tuple[Mark, Mark]], clock: Clock) -> float:
    total_s = 0.0
    for start, end in waits:
        if clock.is_ready(end):
            total_s += max(0.0, clock.seconds_between(start, end))
    return total_s


def _collective_rows(
    step: int,
    calls: list[CollectiveCall],
    times_s: list[tuple[float, float, float]],
    mesh_dims: dict[str, str],
    ddp_wait_s: float,
) -> list[dict[str, Any]]:
    """One row per (group, op); DDP's exposed wait goes to the row of its all-reduces."""
    by_key: dict[tuple[str, str], dict[str, Any]] = {}
    for call, (start_s, end_s, wait_s) in zip(calls, times_s, strict=True):
        busy_s = max(0.0, end_s - start_s)
        if call.ddp_bucket:
            wait_s, ddp_wait_s = ddp_wait_s, 0.0
        group = call.group
        agg = by_key.get((group.name, call.op))
        if agg is None:
            by_key[(group.name, call.op)] = {
                "step": step,
                "group": group.name,
                "op": call.op,
                "group_size": group.size,
                "count": call.count,
                "bytes": call.num_bytes,
                "busy_s": busy_s,
                "wait_s": wait_s,
                "first_seq": call.seq,
                "mesh_dim": mesh_dims.get(group.name),
                "group_ranks": group.ranks,
            }
        else:
            agg["count"] += call.count
            agg["bytes"] += call.num_bytes
            agg["busy_s"] += busy_s
            agg["wait_s"] += wait_s
            if agg["first_seq"] is None or (call.seq is not None and call.seq < agg["first_seq"]):
                agg["first_seq"] = call.seq
    scale = _DURATION_SCALE
    for agg in by_key.values():
        agg["busy_s"] = round(agg["busy_s"] * scale) / scale
        agg["wait_s"] = round(agg["wait_s"] * scale) / scale
    return list(by_key.values())
