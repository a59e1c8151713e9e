"""A finding in words: one line for a terminal, a webhook or the API's `text`, and the
sentences of the dashboard's findings list, side by side.

    critical  rank 5 (node-0)  straggler since step 200  compute +25%  costs the job 4.1%
    warning   job  throughput drop steps 200-399  tokens_per_s -4.0%  cause rank 5

What a finding costs the job is said only when it is known: `evidence["impact"]` (a share
of the job's step time, or a dict with `step_share` and `gpus`) when the analysis states
it, else from a synchronous straggler's effect e (its excess over the job's typical step
time, which every rank waits for): the share of the job's step time lost to it, e / (1 + e).
A throughput change says what caused it (`evidence["caused_by"]`), or that it is job-wide.
A straggler says its pipeline stage (`evidence["stage"]`) and the process group in which
its peers waited for it (`evidence["group"]["group"]`, a label: "tp"); a slow collective
names its group (`evidence["group"]`).

    critical  rank 3 (stage 1, node-0)  straggler since step 200  compute +30%, tp peers waited
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stepscope.schema import Finding
from stepscope.text import labels, numbers
from stepscope.text.numbers import known

WIDTH = 80
_STRAGGLERS = ("straggler_rank", "gpu_throttling")
_CHANGES = ("throughput_drop", "throughput_gain")
_MAX_LISTED_RANKS = 4


# What a finding costs.


def job_cost(finding: Finding) -> float | None:
    """The share of the job's step time this finding costs, when known."""
    impact = finding.evidence.get("impact") if finding.evidence else None
    if isinstance(impact, dict):
        impact = impact.get("step_share", impact.get("share"))
    if known(impact):
        return float(impact)
    if (
        finding.kind in _STRAGGLERS
        and finding.evidence.get("synchronous") is True
        and known(finding.effect)
    ):
        excess = float(finding.effect)
        return excess / (1.0 + excess) if excess > -1.0 else None
    return None


def _gpus(finding: Finding) -> float | None:
    """GPU-equivalents the finding costs (its share of the step time × the ranks), if stated."""
    impact = finding.evidence.get("impact") if finding.evidence else None
    gpus = impact.get("gpus") if isinstance(impact, dict) else None
    return float(gpus) if known(gpus) else None


# Where in the mesh.


def _stage(f: Finding) -> int | None:
    """The straggler's pipeline stage, when the analysis states it."""
    stage = (f.evidence or {}).get("stage")
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


def _waited_in(f: Finding) -> dict[str, Any] | None:
    """The group in which a straggler's peers waited for it (evidence["group"]), if named."""
    group = (f.evidence or {}).get("group")
    return group if isinstance(group, dict) and _group_name(group.get("group")) else None


def _group_name(label: Any) -> str | None:
    """A group label worth saying: "tp", "group 5"; None for "all" (not known) or none."""
    return str(label) if isinstance(label, str) and label not in ("", "all") else None


def _collective_group(f: Finding) -> str | None:
    """The group label of a slow collective (evidence["group"])."""
    group = (f.evidence or {}).get("group")
    return _group_name(group.get("group") if isinstance(group, dict) else group)


# The one-line form.


def finding_line(finding: Finding, width: int = WIDTH) -> str:
    """The finding as one line of at most `width` characters: the longest wording that fits
    (with what it costs in GPUs, then without; fields two spaces apart, then one; the group
    a straggler's peers waited in, then a rank's node, are dropped last)."""
    what = " ".join(filter(None, (_line_what(finding), line_steps(finding))))
    cost, gpus = job_cost(finding), _gpus(finding)
    wordings = [[""]]
    if cost is not None:
        plain = [f"costs the job {cost:.1%} of its step time", f"costs the job {cost:.1%}"]
        wordings = [[*plain, f"job cost {cost:.1%}"]]
        if gpus is not None:
            with_gpus = [f"{c} ({gpus:.1f} GPUs)" for c in plain]
            wordings.insert(0, [*with_gpus, f"job cost {cost:.1%}, {gpus:.1f} GPUs"])
    line = ""
    who = (_line_subject(finding), _line_subject(finding, with_node=False))
    details = (_line_detail(finding), _line_detail(finding, with_group=False))
    # The group a straggler's peers waited in goes first, the node last.
    for subject_, detail in dict.fromkeys((s, d) for s in who for d in details):
        for costs in wordings:
            for sep in ("  ", " "):
                for c in costs:
                    fields = (f"{finding.severity:<8}", subject_, what, detail, c)
                    line = sep.join(f for f in fields if f).rstrip()
                    if len(line) <= width:
                        return line
    return line[: width - 1] + "…"


def _line_subject(f: Finding, *, with_node: bool = True) -> str:
    """Who, briefly: "rank 5 (node-0)", "node node-0 (8 ranks)", "ranks 1,2", "job"."""
    if f.kind in _CHANGES:
        return "job"
    if f.kind == "straggler_node" and f.node:
        return f"node {f.node} ({len(f.ranks)} ranks)"
    if len(f.ranks) == 1:
        stage = _stage(f)
        where = [
            labels.mesh_coord("pp", stage) if stage is not None else None,
            f.node if with_node else None,
        ]
        said = ", ".join(w for w in where if w)
        return f"rank {f.ranks[0]}" + (f" ({said})" if said else "")
    if f.ranks:
        if len(f.ranks) > _MAX_LISTED_RANKS:
            return f"{len(f.ranks)} ranks"
        return "ranks " + ",".join(map(str, f.ranks))
    return f"node {f.node}" if f.node else "job"


def _line_what(f: Finding) -> str:
    if f.kind == "slow_collective" and f.evidence.get("op"):
        group = _collective_group(f)
        return f"slow {f.evidence['op']}" + (f" in {group}" if group else "")
    return labels.kind(f.kind)


def line_steps(f: Finding) -> str:
    """When, briefly: "since step 200", "at step 200", "steps 200-399"."""
    if f.first_step is None:
        return ""
    if f.last_step is None:
        return f"since step {f.first_step}"
    if f.last_step == f.first_step:
        return f"at step {f.first_step}"
    return f"steps {f.first_step}-{f.last_step}"


def _line_detail(f: Finding, *, with_group: bool = True) -> str:
    e = f.evidence or {}
    if f.kind in _STRAGGLERS:
        rank, peers = e.get("rank_median_s"), e.get("peers_median_s")
        component = labels.component(str(e.get("component")), default=f.cause or "")
        if known(rank) and known(peers):
            component = f"{component} {_excess(rank, peers)}"
        group = _waited_in(f) if with_group else None
        return f"{component}, {group['group']} peers waited" if group else component
    if f.kind == "straggler_node":
        return f.cause or ""
    if f.kind == "hang":
        return _hang_detail(f)
    if f.kind == "dataloader_stall" and known(f.observed):
        return f"data {f.observed:.0%} of step"
    if f.kind == "slow_collective" and known(f.effect):
        return f"busbw {f.effect:+.0%}"
    if f.kind in _CHANGES and known(f.effect):
        change = f"{f.metric or 'throughput'} {f.effect:+.1%}"
        return " ".join(filter(None, (change, _line_cause(f))))
    if f.kind == "mfu_low" and known(f.observed):
        expected = f" (< {f.expected:.0%})" if known(f.expected) else ""
        return f"MFU {f.observed:.0%}{expected}"
    if f.kind == "peak_unknown":
        return "no MFU: pass peak_flops"
    return ""


RELATIVE_UP_TO = 10.0
"""A straggler's excess over its peers is said relative up to this factor (+900%), in seconds
per step above it: a data stall of 0.1 s against peers' 40 µs is "+100 ms/step", not +250000%."""


def _excess(rank_s: float, peers_s: float) -> str:
    """How much slower the rank is than its peers: "+32%", or "+100 ms/step" when they are ~0."""
    if peers_s > 0 and rank_s <= RELATIVE_UP_TO * peers_s:
        return f"{rank_s / peers_s - 1:+.0%}"
    return f"+{numbers.seconds(rank_s - peers_s)}/step"


def _hang_detail(f: Finding) -> str:
    """A hang's class and collective: "never entered tp all_reduce #31, 12s"."""
    e = f.evidence or {}
    where = " ".join(
        str(part)
        for part in (
            e.get("group"),
            e.get("op"),
            f"#{e['seq']}" if e.get("seq") is not None else None,
        )
        if part is not None
    )
    stalled = f"{f.observed:.0f}s" if known(f.observed) else ""
    return ", ".join(
        filter(
            None,
            (" ".join(filter(None, (labels.hang_class(str(e.get("class", ""))), where))), stalled),
        )
    )


def hang_sentence(f: Finding) -> str:
    """An open hang in words: "Hang: rank 2 never entered dp all_reduce #31, 12s"."""
    return f"Hang: {_line_subject(f)} {_hang_detail(f)}"


def _line_cause(f: Finding) -> str:
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
        what = labels.kind(str(kind))
    more = f" +{len(causes) - 1}" if len(causes) > 1 else ""
    return f"cause {what}{more}"


# The sentence form (the dashboard's findings list).


@dataclass(frozen=True, slots=True, kw_only=True)
class FindingText:
    """A finding as the findings list shows it; every string is plain text."""

    severity: str
    title: str
    ranks: list[int]
    """Ranks the finding names (the list links each to its rank page)."""
    node: str | None
    stage: int | None = None
    """The rank's pipeline stage, when stated."""
    when: str
    cause: str | None
    effect: str | None
    cost: str | None
    evidence: list[str] = field(default_factory=list)


def finding_text(f: Finding) -> FindingText:
    """The finding in sentences."""
    cost = job_cost(f)
    return FindingText(
        severity=f.severity,
        title=labels.kind(f.kind, long=True),
        ranks=list(f.ranks),
        node=f.node,
        stage=_stage(f),
        when=steps(f),
        cause=cause_text(f),
        effect=_effect(f),
        cost=None if cost is None else f"costs the job {cost:.1%} of its step time",
        evidence=evidence_lines(f),
    )


def cause_text(f: Finding) -> str | None:
    """The finding's cause in words: slower compute is on the rank's GPU only when the
    evidence holds that GPU's telemetry (`evidence["gpu"]`; a CPU job has none)."""
    if not f.cause:
        return None
    return labels.cause(f.cause, long=True, on_gpu=bool((f.evidence or {}).get("gpu")))


def subject(f: Finding | FindingText) -> str:
    """Who the finding is about: rank 5 (stage 1) on node-0001, node node-0001, 12 ranks,
    the job."""
    if len(f.ranks) == 1:
        stage = f.stage if isinstance(f, FindingText) else _stage(f)
        at = f" ({labels.mesh_coord('pp', stage)})" if stage is not None else ""
        return f"rank {f.ranks[0]}{at}" + (f" on {f.node}" if f.node else "")
    if f.node:
        return f"node {f.node}" + (f" ({len(f.ranks)} ranks)" if f.ranks else "")
    if f.ranks:
        return f"{len(f.ranks)} ranks"
    return "the job"


def steps(f: Finding) -> str:
    """When: "since step 1,200 (ongoing)", "from step 200 to 399", "over the whole job"."""
    if f.first_step is None:
        return "over the whole job"
    if f.last_step is None:
        return f"since step {f.first_step:,} (ongoing)"
    if f.last_step == f.first_step:
        return f"at step {f.first_step:,}"
    return f"from step {f.first_step:,} to {f.last_step:,}"


def _effect(f: Finding) -> str | None:
    if not known(f.effect):
        return None
    what = labels.component(f.metric or "", long=True, default=f.metric or "the metric")
    if f.kind == "slow_collective":
        what = "bus bandwidth"
    elif f.kind in ("throughput_drop", "throughput_gain", "mfu_low"):
        what = (f.metric or "throughput").replace("_", " ")
    expected, observed = (
        numbers.value(f.metric, v) if known(v) else None for v in (f.expected, f.observed)
    )
    said = f" ({observed} against {expected} expected)" if expected and observed else ""
    return f"{what} {numbers.signed_share(f.effect)}{said}"


def evidence_lines(f: Finding) -> list[str]:
    """What the analysis saw, one sentence a line (known evidence keys only)."""
    e: dict[str, Any] = f.evidence or {}
    seconds = numbers.seconds
    lines = []
    rank_s, peers_s = e.get("rank_median_s"), e.get("peers_median_s")
    waited = _waited_in(f)
    if f.kind in _STRAGGLERS and waited is not None:
        lines.append(_waited_sentence(f, waited, rank_s, peers_s))
    if known(rank_s) and known(peers_s):
        name = str(e.get("component", "time"))
        lines.append(
            f"Its median {labels.component(name, long=True)} is {seconds(rank_s)} per step "
            f"against {seconds(peers_s)} on the other ranks."
        )
    impact = e.get("impact")
    if isinstance(impact, dict) and known(impact.get("step_s")) and known(impact.get("gpus")):
        lines.append(
            f"The job's steps would be {seconds(impact['step_s'])} shorter with it at the "
            f"median: the work of {impact['gpus']:.1f} GPUs."
        )
    if e.get("scope") == "job-wide":
        lines.append("No rank, data stall or collective explains it: the whole job changed.")
    caused_by = e.get("caused_by")
    if isinstance(caused_by, list) and caused_by:
        first = caused_by[0]
        who = first.get("node") or ", ".join(str(r) for r in first.get("ranks") or []) or "job"
        lines.append(
            f"It starts with a {labels.kind(str(first.get('kind')), long=True)} "
            f"({who}, from step {first.get('first_step')})."
        )
    wait = e.get("comm_wait_s")
    if isinstance(wait, dict) and known(wait.get("rank")) and known(wait.get("peers")):
        lines.append(
            f"It waits {seconds(wait['rank'])} per step on collectives; its peers wait "
            f"{seconds(wait['peers'])} (the others wait for the slow rank)."
        )
    gpu = e.get("gpu")
    if isinstance(gpu, dict):
        lines.extend(_gpu_lines(gpu))
    if known(e.get("data_share")):
        lines.append(f"Data loading takes {e['data_share']:.0%} of the step.")
    if e.get("ranks_flagged") and e.get("ranks_on_node"):
        lines.append(f"{e['ranks_flagged']} of the node's {e['ranks_on_node']} ranks are slow.")
    if e.get("op") and known(e.get("message_bytes_at_least")):
        group = _collective_group(f)
        lines.append(
            f"{e['op']} calls{f' in {group}' if group else ''} of at least "
            f"{numbers.size(e['message_bytes_at_least'])} over {e.get('steps', '?')} steps."
        )
    if known(e.get("p_value")):
        lines.append(
            f"The change is significant (p = {e['p_value']:.2g}; "
            f"{e.get('before_steps', '?')} steps before, {e.get('after_steps', '?')} after)."
        )
    if known(e.get("detected_step")):
        lines.append(f"First detected at step {int(e['detected_step']):,}.")
    return lines


def mesh_sentence(f: Finding) -> str | None:
    """Where in the mesh a finding is, in a sentence: who waited for a straggler, in which
    group a collective is slow; None when the finding says neither."""
    e = f.evidence or {}
    waited = _waited_in(f)
    if f.kind in _STRAGGLERS and waited is not None:
        return _waited_sentence(f, waited, e.get("rank_median_s"), e.get("peers_median_s"))
    group = _collective_group(f) if f.kind == "slow_collective" else None
    if group:
        where = group if group.startswith("group ") else f"the {group} groups"
        return f"The slow {e.get('op') or 'collective'} is in {where}."
    return None


def _waited_sentence(f: Finding, group: dict[str, Any], rank_s: Any, peers_s: Any) -> str:
    """The straggler and who waited for it: Rank 3 (stage 1) is 30% slower in compute; its
    tp peers (ranks 2-3) waited for it, 12 ms per step."""
    who = subject(f).split(" on ")[0]
    name = str((f.evidence or {}).get("component") or "")
    component = labels.component(name, long=True, default=f.cause or "its work")
    if known(rank_s) and known(peers_s) and 0 < rank_s <= RELATIVE_UP_TO * peers_s:
        head = f"{who.capitalize()} is {rank_s / peers_s - 1:.0%} slower in {component}"
    elif known(rank_s) and known(peers_s):
        more = numbers.seconds(rank_s - peers_s)
        head = f"{who.capitalize()} spends {more} more per step in {component}"
    else:
        head = f"{who.capitalize()} is slow"
    members = group.get("group_ranks")
    peers = f" (ranks {members})" if isinstance(members, str) and members else ""
    waited = group.get("peers_lateness_s")
    per_step = f", {numbers.seconds(waited)} per step" if known(waited) else ""
    return f"{head}; its {group['group']} peers{peers} waited for it{per_step}."


def _gpu_lines(gpu: dict[str, Any]) -> list[str]:
    lines = []
    for name, label, unit in (
        ("sm_clock_mhz", "SM clock", "MHz"),
        ("power_w", "power", "W"),
        ("temp_c", "temperature", "°C"),
    ):
        pair = gpu.get(name)
        if isinstance(pair, dict) and known(pair.get("rank")) and known(pair.get("peers")):
            lines.append(
                f"Its GPU {label} is {pair['rank']:.0f} {unit}, peers {pair['peers']:.0f} {unit}."
            )
    if gpu.get("throttled"):
        lines.append("Its GPU reports clock throttling.")
    return lines
