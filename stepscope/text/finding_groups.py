"""Findings in the order a reader acts on them, each job-level change folded under the
rank-level finding that explains it:

    critical  rank 5 (node-0001)  straggler since step 200  compute +32%  job cost 21.1%
      └ job throughput drop steps 200-399: tokens/s -21.0%, MFU -21.0%

The order: severity (critical first); an open hang first of its severity; then what the
finding costs the job (`job_cost`; a throughput drop that nothing explains costs the share
of throughput it lost), largest first; then the first step.

What explains a change is what the analysis says: analysis/throughput/causes.py links a
throughput or MFU change point to the stragglers, stalls and slow collectives that began
(a drop) or ended (a gain) within `cause_steps` steps of it and cost a fair part of it, and
lists them in the change's `evidence["caused_by"]`, the largest first. A change is folded
under the finding of the list whose kind and ranks are those of its first cause and whose
first step is within FOLD_STEPS steps of the cause's (a later pass may move it a little). A
change that is job-wide, or whose cause is not in the list, stays a finding of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from stepscope.schema import SEVERITIES, Finding
from stepscope.text import labels
from stepscope.text.findings import WIDTH, job_cost, line_steps
from stepscope.text.fit import clip
from stepscope.text.numbers import known

T = TypeVar("T")
FOLD_STEPS = 5
"""A change's first cause and a listed finding are the same when their first steps are at
most this far apart."""
CHANGE_KINDS = ("throughput_drop", "throughput_gain")
FOLD_MARK = "  └ "


@dataclass(frozen=True, slots=True)
class FindingGroup(Generic[T]):
    """A finding and the job-level changes it explains (folded under it)."""

    root: T
    folded: list[T] = field(default_factory=list)


def grouped(items: Sequence[T], finding: Callable[[T], Finding]) -> list[FindingGroup[T]]:
    """The items (findings, or what `finding` reads one from) in reading order, each change
    that another item explains folded under that item."""
    found = [finding(item) for item in items]
    folded: dict[int, list[int]] = {}
    roots = []
    for i, f in enumerate(found):
        explainer = _explainer(f, found)
        if explainer is None:
            roots.append(i)
        else:
            folded.setdefault(explainer, []).append(i)
    roots.sort(key=lambda i: _order(found[i], i))
    return [
        FindingGroup(
            items[i],
            [
                items[j]
                for j in sorted(
                    folded.get(i, []),
                    key=lambda j: (found[j].metric == "mfu", found[j].metric or ""),
                )
            ],
        )
        for i in roots
    ]


def _explainer(change: Finding, found: Sequence[Finding]) -> int | None:
    """The index of the finding that the change's first cause names, if it is listed."""
    if change.kind not in CHANGE_KINDS:
        return None
    causes = (change.evidence or {}).get("caused_by")
    if not isinstance(causes, list) or not causes or not isinstance(causes[0], dict):
        return None
    cause: dict[str, Any] = causes[0]
    cause_step = cause.get("first_step")
    for i, f in enumerate(found):
        if f.kind in CHANGE_KINDS or f.kind != cause.get("kind"):
            continue
        if sorted(f.ranks) != sorted(cause.get("ranks") or []):
            continue
        if cause.get("node") and f.node != cause["node"]:
            continue
        if (
            cause_step is None
            or f.first_step is None
            or abs(f.first_step - cause_step) <= FOLD_STEPS
        ):
            return i
    return None


def _order(f: Finding, index: int) -> tuple[int, int, float, float, int]:
    severity = -SEVERITIES.index(f.severity) if f.severity in SEVERITIES else 0
    is_open_hang = f.kind == "hang" and "closed_at" not in (f.evidence or {})
    first = f.first_step if f.first_step is not None else float("inf")
    return (severity, 0 if is_open_hang else 1, -_cost(f), first, index)


def _cost(f: Finding) -> float:
    """What the finding costs the job, for the order: its job cost, else the throughput a
    drop lost, else 0."""
    cost = job_cost(f)
    if cost is not None:
        return cost
    if f.kind == "throughput_drop" and known(f.effect):
        return -float(f.effect)
    return 0.0


def folded_lines(changes: Sequence[Finding], width: int = WIDTH) -> list[str]:
    """The changes a finding explains, indented, one line per kind with every metric on it:
    "  └ job throughput drop steps 200-399: tokens/s -21.0%, MFU -21.0%" (each metric with
    its first step when they differ)."""
    lines = []
    for kind in CHANGE_KINDS:
        same = [f for f in changes if f.kind == kind]
        if not same:
            continue
        spans = {(f.first_step, f.last_step) for f in same}
        together = len(spans) == 1
        parts = []
        for f in same:
            change = f"{labels.metric(f.metric or 'throughput')} {_effect(f)}"
            parts.append(change if together else f"{change} from step {f.first_step}")
        head = " ".join(
            filter(None, ("job", labels.kind(kind), line_steps(same[0]) if together else ""))
        )
        lines.append(clip(f"{FOLD_MARK}{head}: {', '.join(parts)}", width))
    return lines


def _effect(f: Finding) -> str:
    return f"{f.effect:+.1%}" if known(f.effect) else "?"
