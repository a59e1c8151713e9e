"""Findings in words: one readable line per finding, short enough for an 80-column terminal.

    critical  rank 5 (node-0)  straggler since step 200  compute +25%  costs the job 4.1%
    warning   job  throughput drop steps 200-399  tokens_per_s -4.0%  cause rank 5

The CLI, `stepscope analyze` and the webhooks print this line. What a finding costs the job
is said only when it is known: `evidence["impact"]` (a share of the job's step time, or a
dict with `step_share` and `gpus`) when the analysis states it, else from a synchronous
straggler's effect e (its excess over the job's typical step time, which every rank waits
for): the share of the job's step time lost to it, e / (1 + e). A throughput change says
what caused it (`evidence["caused_by"]`), or that it is job-wide. Stdlib only.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from stepscope.schema import Finding

WIDTH = 80

_WHAT = {
    "straggler_rank": "straggler",
    "straggler_node": "slow node",
    "dataloader_stall": "dataloader stall",
    "slow_collective": "slow collective",
    "gpu_throttling": "GPU throttling",
    "throughput_drop": "throughput drop",
    "throughput_gain": "throughput gain",
    "mfu_low": "low MFU",
    "peak_unknown": "peak FLOP/s unknown",
}
_COMPONENTS = {
    "compute_s": "compute",
    "data_s": "data",
    "comm_wait_s": "comm wait",
    "collective_finish_s": "comm",
}
_STRAGGLERS = ("straggler_rank", "gpu_throttling")
_CHANGES = ("throughput_drop", "throughput_gain")
_MAX_LISTED_RANKS = 4


def finding_line(finding: Finding, width: int = WIDTH) -> str:
    """The finding as one line of at most `width` characters: the longest wording that fits
    (with what it costs in GPUs, then without; fields two spaces apart, then one; a rank's
    node is dropped last)."""
    what = " ".join(filter(None, (_what(finding), _when(finding))))
    detail = _detail(finding)
    cost, gpus = job_cost(finding), _gpus(finding)
    wordings = [[""]]
    if cost is not None:
        plain = [f"costs the job {cost:.1%} of its step time", f"costs the job {cost:.1%}"]
        wordings = [[*plain, f"job cost {cost:.1%}"]]
        if gpus is not None:
            with_gpus = [f"{c} ({gpus:.1f} GPUs)" for c in plain]
            wordings.insert(0, [*with_gpus, f"job cost {cost:.1%}, {gpus:.1f} GPUs"])
    line = ""
    for subject in dict.fromkeys((_subject(finding), _subject(finding, with_node=False))):
        for costs in wordings:
            for sep in ("  ", " "):
                for c in costs:
                    fields = (f"{finding.severity:<8}", subject, what, detail, c)
                    line = sep.join(f for f in fields if f).rstrip()
                    if len(line) <= width:
                        return line
    return line[: width - 1] + "…"


def job_cost(finding: Finding) -> float | None:
    """The share of the job's step time this finding costs, when known."""
    impact = finding.evidence.get("impact") if finding.evidence else None
    if isinstance(impact, dict):
        impact = impact.get("step_share", impact.get("share"))
    if _number(impact):
        return float(impact)
    if (
        finding.kind in _STRAGGLERS
        and finding.evidence.get("synchronous") is True
        and _number(finding.effect)
    ):
        excess = float(finding.effect)
        return excess / (1.0 + excess) if excess > -1.0 else None
    return None


def _gpus(finding: Finding) -> float | None:
    """GPU-equivalents the finding costs (its share of the step time × the ranks), if stated."""
    impact = finding.evidence.get("impact") if finding.evidence else None
    gpus = impact.get("gpus") if isinstance(impact, dict) else None
    return float(gpus) if _number(gpus) else None


def _cause(f: Finding) -> str:
    """What caused a throughput change: "cause rank 5", "cause node-0001" (its node), "cause
    slow all_reduce", "cause data stall", or "job-wide"."""
    e = f.evidence or {}
    causes = e.get("caused_by")
    if not causes:
        return "job-wide" if e.get("scope") == "job-wide" else ""
    main = causes[0]
    kind, ranks = main.get("kind"), main.get("ranks") or []
    if kind == "straggler_node" and main.get("node"):
        what = str(main["node"])
    elif kind == "slow_collective":
        what = f"slow {main.get('op') or 'collective'}"
    elif kind == "dataloader_stall":
        what = "data stall" + (f" rank {ranks[0]}" if len(ranks) == 1 else "")
    elif len(ranks) == 1:
        what = f"rank {ranks[0]}"
    else:
        what = _WHAT.get(str(kind), str(kind))
    more = f" +{len(causes) - 1}" if len(causes) > 1 else ""
    return f"cause {what}{more}"


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _subject(f: Finding, *, with_node: bool = True) -> str:
    if f.kind in _CHANGES:
        return "job"
    if f.kind == "straggler_node" and f.node:
        return f"node {f.node} ({len(f.ranks)} ranks)"
    if len(f.ranks) == 1:
        return f"rank {f.ranks[0]}" + (f" ({f.node})" if f.node and with_node else "")
    if f.ranks:
        if len(f.ranks) > _MAX_LISTED_RANKS:
            return f"{len(f.ranks)} ranks"
        return "ranks " + ",".join(map(str, f.ranks))
    return f"node {f.node}" if f.node else "job"


def _what(f: Finding) -> str:
    if f.kind == "slow_collective" and f.evidence.get("op"):
        return f"slow {f.evidence['op']}"
    return _WHAT.get(f.kind, f.kind.replace("_", " "))


def _when(f: Finding) -> str:
    if f.first_step is None:
        return ""
    if f.last_step is None:
        return f"since step {f.first_step}"
    if f.last_step == f.first_step:
        return f"at step {f.first_step}"
    return f"steps {f.first_step}-{f.last_step}"


def _detail(f: Finding) -> str:
    e = f.evidence or {}
    if f.kind in _STRAGGLERS:
        rank, peers = e.get("rank_median_s"), e.get("peers_median_s")
        component = _COMPONENTS.get(str(e.get("component")), f.cause or "")
        if _number(rank) and _number(peers) and peers > 0:
            return f"{component} {rank / peers - 1:+.0%}"
        return component
    if f.kind == "straggler_node":
        return f.cause or ""
    if f.kind == "dataloader_stall" and _number(f.observed):
        return f"data {f.observed:.0%} of step"
    if f.kind == "slow_collective" and _number(f.effect):
        return f"busbw {f.effect:+.0%}"
    if f.kind in _CHANGES and _number(f.effect):
        return " ".join(filter(None, (f"{f.metric or 'throughput'} {f.effect:+.1%}", _cause(f))))
    if f.kind == "mfu_low" and _number(f.observed):
        expected = f" (< {f.expected:.0%})" if _number(f.expected) else ""
        return f"MFU {f.observed:.0%}{expected}"
    if f.kind == "peak_unknown":
        return "no MFU: pass peak_flops"
    return ""
