"""A job's analysis state between passes, kept as JSON in `analysis_state`, and the store
changes a pass collects before it commits them together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from stepscope.analysis.stragglers.segments import SegmentPlan

Write = Callable[[sa.Connection], None]
"""A change a pass makes to the store, applied in the pass's one transaction."""


@dataclass(kw_only=True, slots=True)
class AnalysisState:
    """Where a job's incremental analysis stands: its segment plan, bucket widths, the steps
    and GPU times it covers, and each analysed segment's rank findings."""

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
    def from_doc(cls, doc: dict[str, Any]) -> AnalysisState:
        """The state stored as `doc` (the JSON of `to_doc`)."""
        doc = dict(doc)
        plan = doc.pop("plan", None)
        segments = {int(k): v for k, v in doc.pop("segments", {}).items()}
        return cls(plan=SegmentPlan(**plan) if plan else None, segments=segments, **doc)

    def to_doc(self) -> dict[str, Any]:
        """The state as JSON-ready values."""
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


def widen(lo: Any, hi: Any, a: Any, b: Any) -> tuple[Any, Any]:
    """The union of two ranges, either of which may be unknown (None)."""
    lo = a if lo is None else lo if a is None else min(lo, a)
    hi = b if hi is None else hi if b is None else max(hi, b)
    return lo, hi
