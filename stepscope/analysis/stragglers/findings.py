"""Stragglers: ranks persistently slower than their peers, since when, by how much, why, and
what they cost the job.

Each channel is a per-step metric compared across ranks: `compute` (compute_s), `data`
(data_s) and `communication` (when the rank's collectives finished, relative to the step
start: ready time + collective busy time; the peers of a slow-to-arrive rank wait inside
the collective but finish when it does, so only a slow transfer stands out). A pipeline's
sends and receives are not in it (stepscope.analysis.communication.collectives): they do not
finish together, and a slow stage's neighbours' sends last until it takes them, on every
micro-batch. The neighbours' waits for it are their comm_wait_s, so the stage alone is slow,
in compute. Per step, a
rank's residual is its value minus the median over ranks;
stepscope.analysis.stragglers.rank_levels finds the stretches (of `min_steps` steps, fewer
for a large slowdown) where a rank's residuals are significantly higher than its own level
elsewhere, by at least `min_effect` of the peers' metric (or,
slow throughout, higher than the ranks' spread by `min_offset`), and by `min_step_share` of
the job's step time. Overlapping stretches of one rank in several channels are one
straggler, caused by the channel that costs the most time, communication counting only its
excess beyond the rank's late arrival (a rank slow in compute also finishes its collectives
late).

What a straggler costs the job: in synchronous training the job steps at the pace of its
slowest rank, so per step the job's step time with the rank is the latest arrival at the
collective (or the latest collective finish, for a slow transfer), and without it the
latest among the other ranks (the median rank's at least). The difference, summed over the
straggler's steps and at most the rank's own excess per step, as a share of the job's step
time, is its impact; times the ranks it is the GPUs' worth of time lost. Severity follows it.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
from numpy.typing import NDArray

from stepscope.analysis.communication.groups import pipeline_stage
from stepscope.analysis.config import AnalysisConfig
from stepscope.analysis.frames.grid import (
    Ints,
    Matrix,
    column_sample,
    nanmedian,
    rank_median,
)
from stepscope.analysis.stragglers.rank_levels import (
    MIN_STRETCH_STEPS,
    Thresholds,
    slow_stretches,
)
from stepscope.schema import Cause, Finding, FindingKind

Channel = Literal["compute", "data", "communication"]
"""Where a straggler's excess time is measured; each is named after the cause it shows."""
CHANNEL_METRIC: dict[Channel, str] = {
    "compute": "compute_s",
    "data": "data_s",
    "communication": "collective_finish_s",
}

_WAITED_TOLERANCE = 1.25
"""A rank slow in communication by up to this times another's late arrival waited for it."""

Evidence = Callable[[int, int, int], dict[str, Any]]
"""(rank, first_step, last_step) -> evidence about that rank over those steps."""
BatchEvidence = Callable[[list[tuple[int, int, int]]], list[dict[str, Any]]]
"""The same for several (rank, first_step, last_step) at once."""


@dataclass(kw_only=True, slots=True)
class Episode:
    """A rank persistently slow in one channel, as positions on the grid's step axis."""

    rank_index: int
    channel: Channel
    first: int
    last: int
    confirmed: int
    """Position from which the steps seen so far confirm it (what a live analysis would see)."""
    ongoing: bool
    excess_s: float
    rank_median_s: float
    peers_median_s: float
    statistic: float
    """Its test statistic, in sigmas."""
    reference: str
    """What it is slower than: "own" (its level before or after) or "peers"."""


@dataclass(kw_only=True, slots=True)
class StragglerInput:
    """Per-step matrices (steps × ranks) after warm-up, and what to say about them."""

    job_id: str
    ranks: Ints
    steps: Ints
    step_s: Matrix
    reference_step_s: NDArray[np.float32]
    """Job step time per step (median over ranks)."""
    channels: dict[Channel, Matrix]
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
    group_evidence: Evidence | None = None
    """The process group whose peers waited for the rank most
    (stepscope.analysis.communication.groups)."""
    meshes: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    """rank -> its DeviceMesh coordinates {dim: [coordinate, size]}, where known."""
    settling_steps: int = 0
    """The first step is the job's first after warm-up: a rank slow from it must be slow
    against its peers and stay slow past this many steps (stragglers.rank_levels)."""


def channel_episodes(
    channel: Channel,
    x: Matrix,
    reference_step_s: NDArray[np.float32],
    config: AnalysisConfig,
    median: NDArray[np.float32] | None = None,
    *,
    num_channels: int = 1,
    settling_steps: int = 0,
    peers: bool = True,
) -> list[Episode]:
    """Episodes of ranks persistently above the per-step median of `x` (given or computed)."""
    num_steps, num_ranks = x.shape
    if num_steps < 2 * MIN_STRETCH_STEPS or num_ranks < 2:
        return []
    if median is None:
        median = rank_median(column_sample(x))
    residual = x - median[:, None]
    stretches = slow_stretches(
        residual,
        _floor_s(config.min_effect, median, reference_step_s, config),
        _floor_s(config.min_offset, median, reference_step_s, config),
        _floor_s(
            config.distinct_offset if peers else config.stage_offset,
            median,
            reference_step_s,
            config,
        ),
        min_steps=config.min_steps,
        settling_steps=settling_steps,
        peers=peers,
        thresholds=Thresholds.of(num_steps, num_ranks, num_channels, config.max_p_value),
    )
    episodes = []
    for s in stretches:
        r = s.rank_index
        span = slice(s.first, s.last + 1)
        episodes.append(
            Episode(
                rank_index=r,
                channel=channel,
                first=s.first,
                last=s.last,
                confirmed=s.confirmed,
                ongoing=s.last == num_steps - 1,
                excess_s=nanmedian(residual[span, r]),
                rank_median_s=nanmedian(x[span, r]),
                peers_median_s=nanmedian(median[span]),
                statistic=s.statistic,
                reference=s.reference,
            )
        )
    return episodes


def _floor_s(
    share: float,
    median: NDArray[np.float32],
    reference_step_s: NDArray[np.float32],
    config: AnalysisConfig,
) -> NDArray[np.float64]:
    """Per step, the smallest excess in seconds that counts: `share` of the peers' median of
    the metric, and `min_step_share` of the job's step time."""
    floor = np.fmax(
        share * np.abs(median.astype(np.float64)),
        config.min_step_share * reference_step_s.astype(np.float64),
    )
    return np.nan_to_num(floor, nan=float(np.nanmax(floor, initial=0.0)))


def straggler_findings(data: StragglerInput, config: AnalysisConfig) -> list[Finding]:
    """straggler_rank / gpu_throttling findings, and straggler_node where most of a node is slow.

    A pipeline's stages differ by design (the embeddings' and the head's stages): there a rank
    is slow against the other stages only beyond `stage_offset`."""
    stages = {s for mesh in data.meshes.values() if (s := pipeline_stage(mesh)) is not None}
    episodes = [
        e
        for channel, x in data.channels.items()
        for e in channel_episodes(
            channel,
            x,
            data.reference_step_s,
            config,
            data.medians.get(channel),
            num_channels=len(data.channels),
            settling_steps=data.settling_steps,
            peers=len(stages) < 2,
        )
    ]
    groups = _by_rank_overlap(episodes)
    late = [
        _LateArrival(g[0].rank_index, late_s, *_span(g))
        for g in groups
        if (late_s := _late_s(_excess_s(g))) > 0
    ]
    groups = [g for g in groups if not _waited_for_another(g, late)]
    gpu: list[dict[str, Any] | None] = [None] * len(groups)
    if data.gpu_evidence is not None:
        asked = [i for i, g in enumerate(groups) if _main(g).channel == "compute"]
        answers = data.gpu_evidence([_window(groups[i], data) for i in asked])
        for i, answer in zip(asked, answers, strict=True):
            gpu[i] = answer
    lost = _lost_s(data, groups)
    findings = [
        f
        for group, evidence, lost_s in zip(groups, gpu, lost, strict=True)
        if (f := _finding(group, evidence, lost_s, data, config))
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


def _excess_s(group: list[Episode]) -> dict[Channel, float]:
    """Per channel, the most excess time of the rank's episodes in it."""
    excess: dict[Channel, float] = {}
    for e in group:
        excess[e.channel] = max(excess.get(e.channel, 0.0), e.excess_s)
    return excess


def _costs_s(excess: dict[Channel, float]) -> dict[Channel, float]:
    """`excess`, communication's counted beyond the rank's data and compute excess. A rank
    that reaches its collectives late can finish them late by as much (collective_finish_s
    is ready time + busy time). Only the rest is the transfer's own."""
    costs = dict(excess)
    if "communication" in costs:
        costs["communication"] -= _late_s(excess)
    return costs


def _late_s(excess: dict[Channel, float]) -> float:
    """How late the rank arrives at its collectives: its data and compute excess."""
    return max(excess.get("data", 0.0), 0.0) + max(excess.get("compute", 0.0), 0.0)


def _main(group: list[Episode]) -> Episode:
    """The episode of the channel that costs the most time (_costs_s)."""
    costs = _costs_s(_excess_s(group))
    return max(group, key=lambda e: (costs[e.channel], e.excess_s))


class _LateArrival(NamedTuple):
    """A rank's episodes in which it reaches its collectives late (data and compute)."""

    rank_index: int
    late_s: float
    first: int
    last: int


def _span(group: list[Episode]) -> tuple[int, int]:
    """The first and last step index of a rank's episodes."""
    return min(e.first for e in group), max(e.last for e in group)


def _waited_for_another(group: list[Episode], late: list[_LateArrival]) -> bool:
    """The rank is slow in communication only, by no more than `_WAITED_TOLERANCE` times what
    another rank, over at least half of the same steps, loses arriving late: it waited for
    that rank. A collective's members all finish together, but ranks in different groups
    need not: one can finish late because another arrived late."""
    if _main(group).channel != "communication":
        return False
    comm_s = _costs_s(_excess_s(group))["communication"]
    first, last = _span(group)
    return any(
        other.rank_index != group[0].rank_index
        and comm_s <= _WAITED_TOLERANCE * other.late_s
        and min(last, other.last) - max(first, other.first) + 1 >= (last - first + 1) / 2
        for other in late
    )


def _window(group: list[Episode], data: StragglerInput) -> tuple[int, int, int]:
    first, last = _span(group)
    return int(data.ranks[group[0].rank_index]), int(data.steps[first]), int(data.steps[last])


def _finding(
    group: list[Episode],
    gpu: dict[str, Any] | None,
    lost_s: float | None,
    data: StragglerInput,
    config: AnalysisConfig,
) -> Finding | None:
    r = group[0].rank_index
    rank = int(data.ranks[r])
    first, last = _span(group)
    ongoing = any(e.ongoing for e in group)
    per_channel = _excess_s(group)
    main = _main(group)
    excess_s = sum(v for v in _costs_s(per_channel).values() if v > 0)
    span = slice(first, last + 1)
    expected, synchronous = _typical_step_s(data, span, r, excess_s)
    if not (expected > 0 and excess_s > 0 and math.isfinite(excess_s)):
        return None
    effect = excess_s / expected

    first_step = int(data.steps[first])
    last_step = int(data.steps[last])
    impact = _impact(data, 1, span, lost_s, excess_s, expected, synchronous)
    evidence: dict[str, Any] = {
        "component": CHANNEL_METRIC[main.channel],
        "rank_median_s": main.rank_median_s,
        "peers_median_s": main.peers_median_s,
        "excess_s": {CHANNEL_METRIC[c]: v for c, v in per_channel.items()},
        "statistic": main.statistic,
        "reference": main.reference,
        "detected_step": int(data.steps[min(e.confirmed for e in group)]),
        "min_steps": config.min_steps,
        "synchronous": bool(synchronous),
        "impact": impact,
    }
    if ongoing:
        evidence["last_seen_step"] = last_step
    if data.comm_wait_s is not None:
        evidence["comm_wait_s"] = {
            "rank": nanmedian(data.comm_wait_s[span, r]),
            "peers": nanmedian(rank_median(column_sample(data.comm_wait_s[span]))),
        }

    kind: FindingKind = "straggler_rank"
    cause: Cause = main.channel
    if cause == "compute" and data.compute_includes_wait:
        cause = "unknown"
    if gpu:
        evidence["gpu"] = gpu
        if cause == "compute" and gpu.get("throttled"):
            kind = cause = "gpu_throttling"
    if cause == "communication" and data.comm_evidence is not None:
        evidence["collectives"] = data.comm_evidence(rank, first_step, last_step)
    if data.group_evidence is not None and (
        waited := data.group_evidence(rank, first_step, last_step)
    ):
        evidence["group"] = waited
    stage = pipeline_stage(data.meshes.get(rank))
    if stage is not None:
        evidence["stage"] = stage

    return Finding(
        job_id=data.job_id,
        kind=kind,
        severity=config.severity_of(impact["step_share"], impact["gpus"]),
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


def _lost_s(data: StragglerInput, groups: list[list[Episode]]) -> list[float | None]:
    """Per group (one rank's episodes), the job's step time lost to that rank over its steps,
    in seconds summed over them; None where the ranks' arrival times are unknown.

    Per step, the job's step time with its slow ranks is the latest arrival (or collective
    finish); without them, the latest of the other ranks (the median rank's at least). Slow
    ranks that overlap share that difference as in the airport game's Shapley value: each
    stretch of the difference is split equally among the slow ranks that reach it.
    """
    lost: list[float | None] = [None] * len(groups)
    by_matrix: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        kind = "finish" if _main(group).channel == "communication" else "ready"
        by_matrix.setdefault(kind, []).append(i)
    for kind, members in by_matrix.items():
        if kind == "ready" and data.compute_includes_wait:
            continue
        spans = [_span(groups[i]) for i in members]
        a = min(first for first, _ in spans)
        b = max(last for _, last in spans) + 1
        if kind == "finish":
            xs = data.channels["communication"][a:b]
        else:  # when each rank reached the step's collectives
            xs = data.channels["data"][a:b] + data.channels["compute"][a:b]
        active = np.zeros((b - a, len(members)), dtype=bool)
        columns = [groups[i][0].rank_index for i in members]
        for j, (first, last) in enumerate(spans):
            active[first - a : last - a + 1, j] = True
        others = np.array(xs, dtype=np.float64)
        for j, column in enumerate(columns):
            others[active[:, j], column] = np.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            baseline = np.fmax(np.nanmax(others, axis=1), rank_median(column_sample(xs)))
        excess = np.where(active, xs[:, columns] - baseline[:, None], 0.0)
        excess = np.maximum(np.nan_to_num(excess, nan=0.0), 0.0)
        shares = _airport_shapley(excess)
        for j, i in enumerate(members):
            lost[i] = float(shares[:, j].sum())
    return lost


def _airport_shapley(cost: NDArray[np.float64]) -> NDArray[np.float64]:
    """Per row, each column's Shapley value of the game "the row costs its largest value"."""
    order = np.argsort(cost, axis=1)
    ascending = np.take_along_axis(cost, order, axis=1)
    steps = np.diff(ascending, axis=1, prepend=0.0)
    sharing = cost.shape[1] - np.arange(cost.shape[1])  # players at or above each level
    values = np.cumsum(steps / sharing, axis=1)
    out = np.empty_like(cost)
    np.put_along_axis(out, order, values, axis=1)
    return out


def _impact(
    data: StragglerInput,
    num_slow_ranks: int,
    span: slice,
    lost_s: float | None,
    excess_s: float,
    expected_s: float,
    synchronous: bool,
) -> dict[str, Any]:
    """What slow ranks cost the job over `span`: the job's step time lost per step (`lost_s`
    summed over the span, at most their excess per step), its share of the job's step time,
    and that share times the ranks (GPU-equivalents: the GPUs' worth of time spent waiting)."""
    num_ranks = int(data.ranks.size)
    job_step_s = data.reference_step_s[span].astype(np.float64)
    valid = np.isfinite(job_step_s)
    total_s = float(job_step_s[valid].sum())
    num_steps = max(1, int(valid.sum()))
    if not synchronous:
        # Ranks that do not wait for each other: only these ranks' own work is lost.
        share = num_slow_ranks * excess_s / (expected_s + excess_s) / num_ranks
        method = "own_steps"
    elif lost_s is None:
        # Arrival times unknown: the job is taken to wait for the whole excess.
        share = excess_s / (expected_s + excess_s)
        method = "excess"
    else:
        # No more than the ranks' own excess explains: a rank's spikes above its typical
        # excess, or a wait for another rank, are not what it costs.
        lost_s = min(lost_s, num_slow_ranks * excess_s * num_steps)
        share = lost_s / total_s if total_s > 0 else 0.0
        method = "counterfactual"
    return {
        "step_share": share,
        "step_s": share * total_s / num_steps,
        "gpus": share * num_ranks,
        "world_size": num_ranks,
        "method": method,
    }


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
    for node, on_node in by_node.items():
        for group in _overlapping(on_node):
            flagged = sorted({f.ranks[0] for f in group})
            if len(flagged) < 2 or len(flagged) <= config.node_share * ranks_on[node]:
                out += group
            else:
                out.append(_node_finding(node, group, flagged, ranks_on[node], data, config))
    return sorted(out, key=lambda f: (f.first_step or 0, f.ranks))


def _overlapping(findings: list[Finding]) -> list[list[Finding]]:
    """Findings grouped where their steps overlap (ranks slow at different times, as a
    pipeline's stages slowed in turn, are not a slow node)."""
    groups: list[list[Finding]] = []
    end = -math.inf
    for f in sorted(findings, key=lambda f: f.first_step or 0):
        last = math.inf if f.last_step is None else f.last_step
        if groups and (f.first_step or 0) <= end:
            groups[-1].append(f)
            end = max(end, last)
        else:
            groups.append([f])
            end = last
    return groups


def _node_finding(
    node: str,
    group: list[Finding],
    flagged: list[int],
    ranks_on_node: int,
    data: StragglerInput,
    config: AnalysisConfig,
) -> Finding:
    """One straggler_node finding for rank findings on `node` over overlapping steps."""
    causes = Counter(f.cause for f in group)
    cause = causes.most_common(1)[0][0]
    effect = float(np.median([f.effect or 0.0 for f in group]))
    expected = float(np.median([f.expected or 0.0 for f in group]))
    first_step = min(f.first_step or 0 for f in group)
    last_step = max(int(f.evidence.get("last_seen_step", f.last_step or 0)) for f in group)
    a, b = (int(i) for i in np.searchsorted(data.steps, [first_step, last_step + 1]))
    impacts = [f.evidence["impact"] for f in group]
    lost_s = None
    if all(i["method"] == "counterfactual" for i in impacts):
        lost_s = sum(
            i["step_share"] * _job_time_s(f, data) for i, f in zip(impacts, group, strict=True)
        )
    impact = _impact(
        data,
        len(flagged),
        slice(a, b),
        lost_s,
        effect * expected,
        expected,
        all(f.evidence.get("synchronous") for f in group),
    )
    return Finding(
        job_id=data.job_id,
        kind="straggler_node",
        severity=config.severity_of(impact["step_share"], impact["gpus"]),
        ranks=flagged,
        node=node,
        first_step=first_step,
        last_step=None
        if any(f.last_step is None for f in group)
        else max(f.last_step or 0 for f in group),
        metric="step_s",
        expected=expected,
        observed=expected * (1.0 + effect),
        effect=effect,
        cause=cause,
        evidence={
            "ranks_on_node": ranks_on_node,
            "impact": impact,
            "ranks_flagged": len(flagged),
            "causes": dict(causes),
            "detected_step": min(f.evidence["detected_step"] for f in group),
            "per_rank": [
                {"rank": f.ranks[0], "kind": f.kind, "cause": f.cause, "effect": f.effect}
                for f in group
            ],
        },
    )


def _job_time_s(f: Finding, data: StragglerInput) -> float:
    """The job's step time summed over a finding's steps."""
    last = int(f.evidence.get("last_seen_step", f.last_step or 0))
    a, b = np.searchsorted(data.steps, [f.first_step or 0, last + 1])
    return float(np.nansum(data.reference_step_s[a:b].astype(np.float64)))
