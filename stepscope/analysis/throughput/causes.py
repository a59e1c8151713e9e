"""Causes of job-level changes: a throughput or MFU change point that coincides with the start
(for a drop) or the end (for a gain) of a rank-level finding — a straggler, a dataloader
stall, a slow collective — names that finding as its cause; one without says "job-wide".

It reads only the findings (the job-level ones come from the rollups, the rank-level ones
from the step segments), so the full and the incremental analysis link them alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from stepscope.analysis.config import AnalysisConfig
from stepscope.schema import Finding

CHANGE_KINDS = ("throughput_drop", "throughput_gain")
RANK_LEVEL_KINDS = (
    "straggler_rank",
    "straggler_node",
    "gpu_throttling",
    "dataloader_stall",
    "slow_collective",
)
_MIN_EXPLAINED = 0.25
"""A straggler named as a cause must cost the job at least this share of the change."""


def with_causes(findings: Sequence[Finding], config: AnalysisConfig) -> list[Finding]:
    """The findings, with each throughput/MFU change point's cause set from the rank-level
    findings that began (drop) or ended (gain) within `config.cause_steps` steps of it: its
    evidence lists them (`caused_by`, `scope`), its ranks, node and cause are theirs."""
    rank_level = [f for f in findings if f.kind in RANK_LEVEL_KINDS]
    return [
        _linked(f, rank_level, config.cause_steps) if f.kind in CHANGE_KINDS else f
        for f in findings
    ]


def _linked(change: Finding, rank_level: list[Finding], within_steps: int) -> Finding:
    step = change.first_step
    candidates = []
    if step is not None:
        for f in rank_level:
            edge = f.first_step if change.kind == "throughput_drop" else _end(f)
            if edge is not None and abs(edge - step) <= within_steps and _explains(f, change):
                candidates.append(f)
    candidates.sort(key=lambda f: (-_share(f), f.first_step or 0, f.ranks))
    evidence = {**change.evidence, "caused_by": [_summary(f) for f in candidates]}
    if not candidates:
        return replace(change, evidence={**evidence, "scope": "job-wide"})
    main = candidates[0]
    ranks = sorted({r for f in candidates for r in f.ranks})
    nodes = {f.node for f in candidates}
    scope = "ranks" if ranks else "job"
    if main.kind == "straggler_node":
        scope = "node"
    return replace(
        change,
        ranks=ranks,
        node=main.node if len(nodes) == 1 else None,
        cause=main.cause,
        evidence={**evidence, "scope": scope},
    )


def _end(f: Finding) -> int | None:
    """First step after a rank-level finding ended (None: still ongoing)."""
    return None if f.last_step is None else f.last_step + 1


def _share(f: Finding) -> float:
    impact = f.evidence.get("impact")
    share = impact.get("step_share") if isinstance(impact, dict) else None
    return float(share) if isinstance(share, int | float) else 0.0


def _explains(f: Finding, change: Finding) -> bool:
    """A straggler explains a change it costs a fair part of; other findings carry no figure
    to compare with (a stall or a slow collective at that step is cause enough)."""
    if not isinstance(f.evidence.get("impact"), dict) or change.effect is None:
        return True
    return _share(f) >= _MIN_EXPLAINED * abs(change.effect)


def _summary(f: Finding) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": f.kind,
        "ranks": list(f.ranks),
        "node": f.node,
        "cause": f.cause,
        "first_step": f.first_step,
        "last_step": f.last_step,
    }
    if isinstance(f.evidence.get("impact"), dict):
        out["step_share"] = _share(f)
    if f.kind == "slow_collective":
        out["op"] = f.evidence.get("op")
    return out
