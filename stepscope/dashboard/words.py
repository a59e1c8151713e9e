"""Findings, events and GPU throttle reasons in plain words, for the findings list."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stepscope.dashboard import fmt
from stepscope.describe import job_cost
from stepscope.schema import Finding

KINDS = {
    "straggler_rank": "Straggler rank",
    "straggler_node": "Slow node",
    "dataloader_stall": "Dataloader stall",
    "slow_collective": "Slow collective",
    "gpu_throttling": "GPU throttling",
    "throughput_drop": "Throughput drop",
    "throughput_gain": "Throughput gain",
    "mfu_low": "Low MFU",
    "peak_unknown": "Peak FLOP/s unknown",
}
CAUSES = {
    "data": "waiting for data (the input pipeline)",
    "compute": "slower compute on its GPU",
    "communication": "slower collectives (network or NVLink)",
    "gpu_throttling": "a throttled GPU (clocks held down)",
    "host": "the host (CPU, memory or OS)",
    "unknown": "not determined",
}
COMPONENTS = {
    "compute_s": "compute",
    "data_s": "data loading",
    "comm_wait_s": "waiting on collectives",
    "step_s": "step time",
}
THROTTLE_REASONS = {
    0x1: "GPU idle",
    0x2: "applications clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class FindingText:
    """A finding as the findings list shows it; every string is plain text."""

    severity: str
    title: str
    ranks: list[int]
    """Ranks the finding names (the list links each to its rank page)."""
    node: str | None
    when: str
    cause: str | None
    effect: str | None
    cost: str | None
    evidence: list[str] = field(default_factory=list)


def finding_text(f: Finding) -> FindingText:
    """The plain-words form of a finding."""
    cost = job_cost(f)
    return FindingText(
        severity=f.severity,
        title=KINDS.get(f.kind, f.kind.replace("_", " ").capitalize()),
        ranks=list(f.ranks),
        node=f.node,
        when=_when(f),
        cause=CAUSES.get(f.cause, f.cause) if f.cause else None,
        effect=_effect(f),
        cost=None if cost is None else f"costs the job {cost:.1%} of its step time",
        evidence=evidence_lines(f),
    )


def subject(f: Finding | FindingText) -> str:
    """Who the finding is about: rank 5 on node-0001, node node-0001, 12 ranks, the job."""
    if len(f.ranks) == 1:
        return f"rank {f.ranks[0]}" + (f" on {f.node}" if f.node else "")
    if f.node:
        return f"node {f.node}" + (f" ({len(f.ranks)} ranks)" if f.ranks else "")
    if f.ranks:
        return f"{len(f.ranks)} ranks"
    return "the job"


def _when(f: Finding) -> str:
    if f.first_step is None:
        return "over the whole job"
    if f.last_step is None:
        return f"since step {f.first_step:,} (ongoing)"
    if f.last_step == f.first_step:
        return f"at step {f.first_step:,}"
    return f"from step {f.first_step:,} to {f.last_step:,}"


def _effect(f: Finding) -> str | None:
    if not fmt.known(f.effect):
        return None
    assert f.effect is not None
    what = COMPONENTS.get(f.metric or "", f.metric or "the metric")
    if f.kind == "slow_collective":
        what = "bus bandwidth"
    elif f.kind in ("throughput_drop", "throughput_gain", "mfu_low"):
        what = (f.metric or "throughput").replace("_", " ")
    expected = _value(f.metric, f.expected)
    observed = _value(f.metric, f.observed)
    numbers = f" ({observed} against {expected} expected)" if expected and observed else ""
    return f"{what} {fmt.signed_share(f.effect)}{numbers}"


def _value(metric: str | None, value: float | None) -> str | None:
    if not fmt.known(value):
        return None
    if metric and metric.endswith("_per_s"):
        return f"{fmt.rate(value)}/s"
    if metric and metric.endswith("_s"):
        return fmt.seconds(value)
    if metric and metric.endswith("_bps"):
        return fmt.bytes_per_s(value)
    if metric == "mfu":
        return fmt.share(value)
    return fmt.rate(value)


def evidence_lines(f: Finding) -> list[str]:
    """What the analysis saw, one sentence a line (known evidence keys only)."""
    e: dict[str, Any] = f.evidence or {}
    lines = []
    rank_s, peers_s = e.get("rank_median_s"), e.get("peers_median_s")
    if _number(rank_s) and _number(peers_s):
        component = COMPONENTS.get(str(e.get("component")), str(e.get("component", "time")))
        lines.append(
            f"Its median {component} is {fmt.seconds(rank_s)} per step against "
            f"{fmt.seconds(peers_s)} on the other ranks."
        )
    impact = e.get("impact")
    if isinstance(impact, dict) and _number(impact.get("step_s")) and _number(impact.get("gpus")):
        lines.append(
            f"The job's steps would be {fmt.seconds(impact['step_s'])} shorter with it at the "
            f"median: the work of {impact['gpus']:.1f} GPUs."
        )
    if e.get("scope") == "job-wide":
        lines.append("No rank, data stall or collective explains it: the whole job changed.")
    caused_by = e.get("caused_by")
    if isinstance(caused_by, list) and caused_by:
        first = caused_by[0]
        who = first.get("node") or ", ".join(str(r) for r in first.get("ranks") or []) or "job"
        lines.append(
            f"It starts with a {KINDS.get(str(first.get('kind')), first.get('kind'))} "
            f"({who}, from step {first.get('first_step')})."
        )
    wait = e.get("comm_wait_s")
    if isinstance(wait, dict) and _number(wait.get("rank")) and _number(wait.get("peers")):
        lines.append(
            f"It waits {fmt.seconds(wait['rank'])} per step on collectives; its peers wait "
            f"{fmt.seconds(wait['peers'])} (the others wait for the slow rank)."
        )
    gpu = e.get("gpu")
    if isinstance(gpu, dict):
        lines.extend(_gpu_lines(gpu))
    if _number(e.get("data_share")):
        lines.append(f"Data loading takes {e['data_share']:.0%} of the step.")
    if e.get("ranks_flagged") and e.get("ranks_on_node"):
        lines.append(f"{e['ranks_flagged']} of the node's {e['ranks_on_node']} ranks are slow.")
    if e.get("op") and _number(e.get("message_bytes_at_least")):
        lines.append(
            f"{e['op']} calls of at least {fmt.size(e['message_bytes_at_least'])} "
            f"over {e.get('steps', '?')} steps."
        )
    if _number(e.get("p_value")):
        lines.append(
            f"The change is significant (p = {e['p_value']:.2g}; "
            f"{e.get('before_steps', '?')} steps before, {e.get('after_steps', '?')} after)."
        )
    if _number(e.get("detected_step")):
        lines.append(f"First detected at step {int(e['detected_step']):,}.")
    return lines


def _gpu_lines(gpu: dict[str, Any]) -> list[str]:
    lines = []
    for name, label, show in (
        ("sm_clock_mhz", "SM clock", lambda v: f"{v:.0f} MHz"),
        ("power_w", "power", lambda v: f"{v:.0f} W"),
        ("temp_c", "temperature", lambda v: f"{v:.0f} °C"),
    ):
        pair = gpu.get(name)
        if isinstance(pair, dict) and _number(pair.get("rank")) and _number(pair.get("peers")):
            lines.append(f"Its GPU {label} is {show(pair['rank'])}, peers {show(pair['peers'])}.")
    if gpu.get("throttled"):
        lines.append("Its GPU reports clock throttling.")
    return lines


def throttle_reasons(mask: int) -> list[str]:
    """Names of the NVML clocks-event reasons set in `mask`."""
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and fmt.known(value)
