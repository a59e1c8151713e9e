"""Stragglers: ranks persistently slower than their peers, since when, by how much, and why.

Each channel is a per-step metric compared across ranks: `compute` (compute_s), `data`
(data_s) and `communication` (when the rank's collectives finished, relative to the step
start: ready time + collective busy time; the peers of a slow-to-arrive rank wait inside
the collective but finish when it does, so only a slow transfer stands out). Per step, a
rank's residual is its value minus the median over ranks; the step is slow for the rank
when the residual exceeds `min_effect` × the job's step time and the noise floor. A rank
slow in `persistence` × `window_steps` of a sliding window is a straggler from the first
slow step of that window; it recovered at the last slow step before the windows stop
confirming it. Overlapping episodes of one rank in several channels are one straggler,
caused by the channel that costs the most time.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from stepscope.analysis.config import AnalysisConfig
from stepscope.analysis.grid import (
    Ints,
    Matrix,
    column_sample,
    nanmedian,
    rank_median,
    robust_sigma,
)
from stepscope.analysis.runs import offset, onset, runs
from stepscope.schema import Finding

CHANNEL_METRIC = {
    "compute": "compute_s",
    "data": "data_s",
    "communication": "collective_finish_s",
}

Evidence = Callable[[int, int, int], dict[str, Any]]
"""(rank, first_step, last_step) -> evidence about that rank over those steps."""
BatchEvidence = Callable[[list[tuple[int, int, int]]], list[dict[str, Any]]]
"""The same for several (rank, first_step, last_step) at once."""


@dataclass(kw_only=True, slots=True)
class Episode:
    """A rank persistently slow in one channel, as positions on the grid's step axis."""

    rank_index: int
    channel: str
    first: int
    last: int
    confirmed: int
    """Position where the window first confirmed it (what a live analysis would see)."""
    ongoing: bool
    excess_s: float
    rank_median_s: float
    peers_median_s: float
    slow_share: float


@dataclass(kw_only=True, slots=True)
class StragglerInput:
    """Per-step matrices (steps × ranks) after warm-up, and what to say about them."""

    job_id: str
    ranks: Ints
    steps: Ints
    step_s: Matrix
    reference_step_s: NDArray[np.float32]
    """Job step time per step (median over ranks)."""
    channels: dict[str, Matrix]
    comm_wait_s: Matrix | None = None
    transfer_s: NDArray[np.float32] | None = None
    """Per step, the collectives' own duration (smallest busy time over ranks, summed over ops)."""
    compute_includes_wait: bool = False
    """compute_s was derived without comm_wait_s: a slow rank's cause is unknown."""
    medians: dict[str, NDArray[np.float32]] = field(default_factory=dict)
    """Per-step medians over ranks already computed, by channel."""
    nodes: Mapping[int, str] = field(default_factory=dict)
    gpu_evidence: BatchEvidence | None = None
    comm_evidence: Evidence | None = None


def channel_episodes(
    channel: str,
    x: Matrix,
    reference_step_s: NDArray[np.float32],
    config: AnalysisConfig,
    median: NDArray[np.float32] | None = None,
) -> list[Episode]:
    """Episodes of ranks persistently above the per-step median of `x` (given or computed)."""
    num_steps = x.shape[0]
    window = config.window_steps
    need = config.window_min_slow
    if num_steps < need or x.shape[1] < 2:
        return []
    if median is None:
        median = rank_median(column_sample(x))
    residual = x - median[:, None]
    sigma = robust_sigma(residual)
    threshold = np.maximum(config.min_effect * reference_step_s, config.noise_floor_sigmas * sigma)
    with np.errstate(invalid="ignore"):
        slow = residual > threshold[:, None]

    episodes = []
    for r in _candidates(slow, window, need):
        flags = slow[:, r]
        counts = np.cumsum(flags, dtype=np.int32)
        counts[window:] -= counts[:-window].copy()
        for c0, c1 in runs(counts >= need, merge_gap=window):
            first = onset(flags, max(0, c0 - window + 1), c0, config.persistence)
            ongoing = c1 == num_steps - 1
            last = num_steps - 1 if ongoing else offset(flags, first, c1, config.persistence)
            span = slice(first, last + 1)
            episodes.append(
                Episode(
                    rank_index=int(r),
                    channel=channel,
                    first=first,
                    last=last,
                    confirmed=int(c0),
                    ongoing=ongoing,
                    excess_s=nanmedian(residual[span, r]),
                    rank_median_s=nanmedian(x[span, r]),
                    peers_median_s=nanmedian(median[span]),
                    slow_share=float(flags[span].mean()),
                )
            )
    return episodes


def _candidates(slow: NDArray[np.bool_], window: int, need: int) -> list[int]:
    """Ranks that may have `need` slow steps in some window (exact check left to the caller).

    Any `window` consecutive steps lie within two adjacent blocks of `window` steps, so a
    rank whose adjacent block pairs all hold fewer than `need` slow steps cannot qualify.
    """
    num_steps, num_ranks = slow.shape
    blocks = -(-num_steps // window)
    padded = np.zeros((blocks * window, num_ranks), dtype=np.uint8)
    padded[:num_steps] = slow
    per_block = padded.reshape(blocks, window, num_ranks).sum(axis=1, dtype=np.int32)
    pairs = per_block[:-1] + per_block[1:] if blocks > 1 else per_block
    return np.flatnonzero(pairs.max(axis=0) >= need).tolist()


def straggler_findings(data: StragglerInput, config: AnalysisConfig) -> list[Finding]:
    """straggler_rank / gpu_throttling findings, and straggler_node where most of a node is slow."""
    episodes = [
        e
        for channel, x in data.channels.items()
        for e in channel_episodes(
            channel, x, data.reference_step_s, config, data.medians.get(channel)
        )
    ]
    groups = _by_rank_overlap(episodes)
    gpu: list[dict[str, Any] | None] = [None] * len(groups)
    if data.gpu_evidence is not None:
        asked = [i for i, g in enumerate(groups) if _main(g).channel == "compute"]
        answers = data.gpu_evidence([_window(groups[i], data) for i in asked])
        for i, answer in zip(asked, answers, strict=True):
            gpu[i] = answer
    findings = [
        f
        for group, evidence in zip(groups, gpu, strict=True)
        if (f := _finding(group, evidence, data, config))
    ]
    return _node_findings(findings, data, config)


def _by_rank_overlap(episodes: list[Episode]) -> list[list[Episode]]:
    """Episodes grouped per rank where their step ranges overlap."""
    groups: list[list[Episode]] = []
    for e in sorted(episodes, key=lambda e: (e.rank_index, e.first)):
        last = groups[-1] if groups else None
        if last and last[0].rank_index == e.rank_index and e.first <= max(g.last for g in last):
            last.append(e)
        else:
            groups.append([e])
    return groups


def _main(group: list[Episode]) -> Episode:
    return max(group, key=lambda e: e.excess_s)


def _window(group: list[Episode], data: StragglerInput) -> tuple[int, int, int]:
    rank = int(data.ranks[group[0].rank_index])
    return (
        rank,
        int(data.steps[min(e.first for e in group)]),
        int(data.steps[max(e.last for e in group)]),
    )


def _finding(
    group: list[Episode], gpu: dict[str, Any] | None, data: StragglerInput, config: AnalysisConfig
) -> Finding | None:
    r = group[0].rank_index
    rank = int(data.ranks[r])
    first = min(e.first for e in group)
    last = max(e.last for e in group)
    ongoing = any(e.ongoing for e in group)
    per_channel: dict[str, float] = {}
    for e in group:
        per_channel[e.channel] = max(per_channel.get(e.channel, 0.0), e.excess_s)
    main = _main(group)
    excess_s = sum(v for v in per_channel.values() if v > 0)
    span = slice(first, last + 1)
    expected, synchronous = _typical_step_s(data, span, r, excess_s)
    if not (expected > 0 and math.isfinite(excess_s)):
        return None
    effect = excess_s / expected
    if effect < config.min_effect:
        return None

    first_step = int(data.steps[first])
    last_step = int(data.steps[last])
    evidence: dict[str, Any] = {
        "component": CHANNEL_METRIC[main.channel],
        "rank_median_s": main.rank_median_s,
        "peers_median_s": main.peers_median_s,
        "excess_s": {CHANNEL_METRIC[c]: v for c, v in per_channel.items()},
        "slow_share": main.slow_share,
        "detected_step": int(data.steps[min(e.confirmed for e in group)]),
        "window_steps": config.window_steps,
        "synchronous": bool(synchronous),
    }
    if ongoing:
        evidence["last_seen_step"] = last_step
    if data.comm_wait_s is not None:
        evidence["comm_wait_s"] = {
            "rank": nanmedian(data.comm_wait_s[span, r]),
            "peers": nanmedian(rank_median(column_sample(data.comm_wait_s[span]))),
        }

    kind = "straggler_rank"
    cause = main.channel
    if cause == "compute" and data.compute_includes_wait:
        cause = "unknown"
    if gpu:
        evidence["gpu"] = gpu
        if cause == "compute" and gpu.get("throttled"):
            kind = cause = "gpu_throttling"
    if cause == "communication" and data.comm_evidence is not None:
        evidence["collectives"] = data.comm_evidence(rank, first_step, last_step)

    return Finding(
        job_id=data.job_id,
        kind=kind,
        severity=config.severity_of(effect),
        ranks=[rank],
        node=data.nodes.get(rank),
        first_step=first_step,
        last_step=None if ongoing else last_step,
        metric="step_s",
        expected=expected,
        observed=expected + excess_s,
        effect=effect,
        cause=cause,
        evidence=evidence,
    )


def _typical_step_s(
    data: StragglerInput, span: slice, r: int, excess_s: float
) -> tuple[float, bool]:
    """The job's step time with typical ranks only, and whether the ranks step together."""
    job_step_s = nanmedian(data.reference_step_s[span])
    rank_step_s = nanmedian(data.step_s[span, r])
    synchronous = rank_step_s - job_step_s < 0.5 * excess_s
    if not synchronous:
        return job_step_s, False
    if data.comm_wait_s is None:
        # The job's step already includes this rank's delay.
        return job_step_s - excess_s, True
    # A typical rank's ready time plus the sync cost alone (the last rank to arrive waits
    # only for the transfer): what the step takes when no rank is late.
    wait = data.comm_wait_s[span]
    if data.transfer_s is not None:
        sync_s = nanmedian(data.transfer_s[span])
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            sync_s = nanmedian(np.nanmin(wait, axis=1))
    ready_s = nanmedian(rank_median(column_sample(data.step_s[span]) - column_sample(wait)))
    return ready_s + sync_s, True


def _node_findings(
    findings: list[Finding], data: StragglerInput, config: AnalysisConfig
) -> list[Finding]:
    """Rank findings on a node replaced by one straggler_node when most of its ranks are slow."""
    if not data.nodes:
        return findings
    ranks_on = Counter(data.nodes.values())
    by_node: dict[str, list[Finding]] = {}
    for f in findings:
        if f.node is not None:
            by_node.setdefault(f.node, []).append(f)
    out = [f for f in findings if f.node is None]
    for node, group in by_node.items():
        flagged = sorted({f.ranks[0] for f in group})
        if len(flagged) < 2 or len(flagged) <= config.node_share * ranks_on[node]:
            out += group
            continue
        causes = Counter(f.cause for f in group)
        effect = float(np.median([f.effect or 0.0 for f in group]))
        expected = float(np.median([f.expected or 0.0 for f in group]))
        out.append(
            Finding(
                job_id=data.job_id,
                kind="straggler_node",
                severity=config.severity_of(effect),
                ranks=flagged,
                node=node,
                first_step=min(f.first_step or 0 for f in group),
                last_step=None
                if any(f.last_step is None for f in group)
                else max(f.last_step or 0 for f in group),
                metric="step_s",
                expected=expected,
                observed=expected * (1.0 + effect),
                effect=effect,
                cause=causes.most_common(1)[0][0],
                evidence={
                    "ranks_on_node": ranks_on[node],
                    "ranks_flagged": len(flagged),
                    "causes": dict(causes),
                    "detected_step": min(f.evidence["detected_step"] for f in group),
                    "per_rank": [
                        {"rank": f.ranks[0], "kind": f.kind, "cause": f.cause, "effect": f.effect}
                        for f in group
                    ],
                },
            )
        )
    return sorted(out, key=lambda f: (f.first_step or 0, f.ranks))
