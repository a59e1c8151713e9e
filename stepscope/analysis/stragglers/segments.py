"""Per-rank analysis of long jobs in fixed step segments, and the findings stitched together.

Rank-level detectors (stragglers, data stalls) compare every rank with its peers step by
step, so their cost grows with ranks × steps. A job is cut into segments of a fixed number
of steps (about `AnalysisConfig.segment_cells` rank-steps each), aligned to the job's first
step after warm-up. A segment is analysed with one window of the previous segment's steps
as context, so an episode crossing the boundary is seen from both sides; findings that end
inside the context belong to the previous segment, and an episode still ongoing at a
segment's end continues into the next one's finding of the same kind and ranks.

Because a segment's findings depend only on its own steps and its context, a live job needs
only its last segment re-analysed, and findings stitched from segments analysed at
different times equal those of analysing the whole job at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from stepscope.analysis.config import AnalysisConfig
from stepscope.schema import SEVERITIES, Finding


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Where a job's segments start and how many steps each has."""

    base_step: int
    """First step after warm-up: segment 0 starts here."""
    segment_steps: int
    context_steps: int

    @classmethod
    def of(cls, first_step: int, num_ranks: int, config: AnalysisConfig) -> SegmentPlan:
        """The plan of a job whose first step is `first_step`, with `num_ranks` ranks."""
        segment_steps = max(4 * config.window_steps, config.segment_cells // max(num_ranks, 1))
        return cls(
            base_step=first_step + config.warmup_steps,
            segment_steps=segment_steps,
            context_steps=config.window_steps,
        )

    def index(self, step: int) -> int:
        """The segment holding `step` (steps in the warm-up belong to segment 0)."""
        return max(0, (step - self.base_step) // self.segment_steps)

    def start(self, k: int) -> int:
        return self.base_step + k * self.segment_steps

    def span(self, k: int) -> tuple[int, int]:
        """First and last step (inclusive) that segment k's analysis reads, context included."""
        first = self.start(k) - (self.context_steps if k > 0 else 0)
        return first, self.start(k + 1) - 1

    def touched(self, first_step: int, last_step: int) -> range:
        """Segments whose analysis reads a step in first_step..last_step."""
        return range(self.index(first_step), self.index(last_step + self.context_steps) + 1)

    def owned(self, k: int, findings: Sequence[Finding]) -> list[Finding]:
        """Findings of segment k's analysis, less those that ended within its context."""
        start = self.start(k)
        return [f for f in findings if k == 0 or f.last_step is None or f.last_step >= start]


def _key(f: Finding) -> tuple[object, ...]:
    return (f.kind, f.node) if f.kind == "straggler_node" else (f.kind, tuple(f.ranks))


def stitch(plan: SegmentPlan, per_segment: Mapping[int, Sequence[Finding]]) -> list[Finding]:
    """One list of findings from each segment's: an episode ongoing at a segment's end (or
    ending within a window of it) merges with the next segment's finding of the same key."""
    out: list[Finding] = []
    open_by_key: dict[tuple[object, ...], tuple[Finding, int]] = {}
    """Findings that reached the last window of their segment: key → (finding, last step)."""
    for k in sorted(per_segment):
        start, end = plan.start(k), plan.start(k + 1) - 1
        reaching, open_by_key = open_by_key, {}
        for f in per_segment[k]:
            key = _key(f)
            previous = reaching.pop(key, None)
            if previous is not None and (f.first_step or start) <= previous[1] + 1:
                out.remove(previous[0])
                f = _merged(previous[0], previous[1], f, end)
            out.append(f)
            last = end if f.last_step is None else f.last_step
            if last >= end - plan.context_steps:
                open_by_key[key] = (f, last)
        for f, last in reaching.values():  # ongoing at the previous boundary, not after it
            if f.last_step is None:
                out[out.index(f)] = replace(f, last_step=last)
    return sorted(out, key=lambda f: (f.first_step or 0, f.kind, f.ranks))


def _merged(a: Finding, a_last: int, b: Finding, segment_end: int) -> Finding:
    """A finding from a's start to b's end; its figures weighted by the steps of each part."""
    b_last = segment_end if b.last_step is None else b.last_step
    w_a = max(1, a_last - (a.first_step or 0) + 1)
    w_b = max(1, b_last - max(b.first_step or 0, a_last + 1) + 1)

    def weighted(x: float | None, y: float | None) -> float | None:
        if x is None or y is None:
            return y if x is None else x
        return (x * w_a + y * w_b) / (w_a + w_b)

    expected = weighted(a.expected, b.expected)
    observed = weighted(a.observed, b.observed)
    effect = weighted(a.effect, b.effect)
    if a.kind != "dataloader_stall" and expected and observed is not None:
        effect = observed / expected - 1.0
    evidence = dict((a if w_a > w_b else b).evidence)
    evidence.pop("last_seen_step", None)
    if "last_seen_step" in b.evidence:
        evidence["last_seen_step"] = b.evidence["last_seen_step"]
    detected = [e["detected_step"] for e in (a.evidence, b.evidence) if "detected_step" in e]
    if detected:
        evidence["detected_step"] = min(detected)
    first, second = (e.get("impact") for e in (a.evidence, b.evidence))
    if isinstance(first, dict) and isinstance(second, dict):
        # What the episode costs the job over both parts (shares weighted by their steps).
        impact = dict(first if w_a > w_b else second)
        for key in ("step_share", "step_s", "gpus"):
            impact[key] = weighted(first.get(key), second.get(key))
        evidence["impact"] = impact
    return replace(
        b,
        first_step=a.first_step,
        ranks=sorted({*a.ranks, *b.ranks}),
        expected=expected,
        observed=observed,
        effect=effect,
        severity=max(a.severity, b.severity, key=SEVERITIES.index),
        evidence=evidence,
    )
