"""Hang attribution (#19): from each rank's latest report, who holds the job up, in which
collective, and how the hang came about.

A blocked rank in group g at sequence number s waits for the members of g whose last
enqueued sequence number is below s (research §3). A send or recv is blocked in its
channel, a two-member group ("{group}:{src}>{dst}") whose members count their own sends
and recvs: the k-th recv waits for the sender's k-th send. Following these edges from the ranks
that report a hang ends at roots: ranks that are not blocked in any collective (never
entered: their stack says where they are) or that stopped reporting (silent). Where every
member of g entered, the members either called different collectives (mismatched) or the
collective does not complete (suspect the link or the GPUs). The missing members of a
(group, seq) are computed once, so a pass costs O(sum of group sizes).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stepscope import schema

Frame = tuple[str, int, str]
"""(file, line, function) of one stack frame."""
Stack = tuple[Frame, ...]
"""Innermost frame last."""
Point = tuple[str, int]
"""(group, seq): one collective call of a group."""

MAX_LISTED_RANKS = 1000
"""Ranks listed per state in ranks_by_state (counts are always whole)."""
MAX_OUTLIER_STACKS = 8
CAUSE_OF_CLASS: dict[schema.HangClass, schema.Cause] = {
    "never_entered": "host",
    "mismatched": "host",
    "not_completing": "communication",
    "silent": "host",
}


class Frontier(NamedTuple):
    """A rank's view of one process group: its last enqueued and completed sequence numbers."""

    group: str
    mesh_dim: str | None
    group_ranks: str | None
    size: int | None
    enqueued: int
    completed: int


class Blocked(NamedTuple):
    """The collective a rank's training thread sits in."""

    group: str
    op: str
    seq: int
    since_ts: float | None
    bytes: int | None = None


@dataclass(kw_only=True, slots=True)
class RankReport:
    """A rank's latest hang report or heartbeat (the wire format of POST /v1/hangs)."""

    rank: int
    ts: float
    kind: str
    """"hang" or "heartbeat"."""
    node: str | None = None
    step: int | None = None
    section: str | None = None
    phase: str | None = None
    last_progress_ts: float | None = None
    stalled_s: float | None = None
    blocked: Blocked | None = None
    frontiers: dict[str, Frontier] = field(default_factory=dict)
    stack: Stack | None = None
    stack_source: str | None = None

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> RankReport:
        """A report from its wire (or stored) fields."""
        blocked = doc.get("blocked")
        stack = doc.get("stack")
        return cls(
            rank=doc["rank"],
            ts=doc["ts"],
            kind=doc["kind"],
            node=doc.get("node"),
            step=doc.get("step"),
            section=doc.get("section"),
            phase=doc.get("phase"),
            last_progress_ts=doc.get("last_progress_ts"),
            stalled_s=doc.get("stalled_s"),
            blocked=None
            if blocked is None
            else Blocked(
                group=blocked["group"],
                op=blocked["op"],
                seq=blocked["seq"],
                since_ts=blocked.get("since_ts"),
                bytes=blocked.get("bytes"),
            ),
            frontiers={
                f["group"]: Frontier(
                    f["group"],
                    f.get("mesh_dim"),
                    f.get("group_ranks"),
                    f.get("size"),
                    f["enqueued"],
                    f["completed"],
                )
                for f in doc.get("frontiers") or ()
            },
            stack=None
            if stack is None
            else tuple((s.get("file", ""), s.get("line", 0), s.get("function", "")) for s in stack),
            stack_source=doc.get("stack_source"),
        )


@dataclass(slots=True)
class HangState:
    """What a job's latest reports say: a hang finding, or why there is none."""

    hanging: bool
    """Some rank reports a hang (after `ignore_hangs_before_ts`)."""
    finding: schema.Finding | None
    """The hang, attributed; None when not hanging, not known yet or explained."""
    pending: list[int]
    """Ranks whose state is needed and not known yet (no report since their peers blocked)."""
    explained_by_phase: bool
    """The ranks held up are inside a declared phase (checkpointing, compilation)."""
    ranks_by_state: dict[str, Any]
    since_ts: float | None
    resumed_ts: float | None
    """When progress resumed, if a heartbeat says the job moved on (see `resumed`)."""


@dataclass(slots=True)
class _Culprit:
    rank: int
    hang_class: schema.HangClass
    point: Point


@dataclass(slots=True)
class _Job:
    """The reports indexed for the wait-for graph; group members found when first needed."""

    by_rank: dict[int, RankReport]
    at_point: dict[Point, list[int]]
    """Blocked ranks per (group, seq)."""
    blocked_in: dict[str, int]
    """A rank blocked in each group."""
    now_ts: float
    _members: dict[str, list[int]] = field(default_factory=dict)
    _mesh_dims: dict[str, str | None] = field(default_factory=dict)
    _reporting: dict[str, set[int]] | None = None
    _missing: dict[Point, list[int]] = field(default_factory=dict)
    _waits: dict[Point, tuple[float, float | None]] = field(default_factory=dict)

    def _describe(self, group: str) -> None:
        """Members (from a compact group_ranks, else every rank that reports the group) and
        mesh dimension of `group`."""
        blocked_here = self.blocked_in.get(group)
        frontier = None if blocked_here is None else self.by_rank[blocked_here].frontiers.get(group)
        listed = None
        if frontier is not None and frontier.group_ranks:
            listed = schema.expand_ranks(frontier.group_ranks)
        if listed is None:
            if self._reporting is None:
                self._reporting = defaultdict(set)
                for report in self.by_rank.values():
                    for name in report.frontiers:
                        self._reporting[name].add(report.rank)
            listed = sorted(self._reporting.get(group, ()))
            if frontier is None:
                frontier = next(
                    (self.by_rank[r].frontiers[group] for r in listed if r in self.by_rank), None
                )
        self._members[group] = listed
        self._mesh_dims[group] = frontier.mesh_dim if frontier is not None else None

    def members(self, group: str) -> list[int]:
        if group not in self._members:
            self._describe(group)
        return self._members[group]

    def mesh_dim(self, group: str) -> str | None:
        if group not in self._mesh_dims:
            self._describe(group)
        return self._mesh_dims[group]

    def missing(self, point: Point) -> list[int]:
        """Members of the group that have not enqueued `seq` (or never reported the group)."""
        cached = self._missing.get(point)
        if cached is not None:
            return cached
        group, seq = point
        out = []
        by_rank = self.by_rank
        for m in self.members(group):
            report = by_rank.get(m)
            frontier = report.frontiers.get(group) if report else None
            if frontier is None or frontier.enqueued < seq:
                out.append(m)
        self._missing[point] = out
        return out

    def point_since(self, point: Point) -> float:
        """When the first rank began to wait at `point`."""
        return self._wait(point)[0]

    def point_reported(self, point: Point) -> float | None:
        """The newest report of the ranks waiting at `point` (None when none waits there)."""
        return self._wait(point)[1]

    def _wait(self, point: Point) -> tuple[float, float | None]:
        """(point_since, point_reported), once per point: they are asked of every rank missing
        from it."""
        cached = self._waits.get(point)
        if cached is None:
            waiting = [self.by_rank[r] for r in self.at_point.get(point, ())]
            known = [r.blocked.since_ts for r in waiting if r.blocked.since_ts is not None]  # type: ignore[union-attr]
            cached = self._waits[point] = (
                min(known) if known else self.now_ts,
                max((r.ts for r in waiting), default=None),
            )
        return cached


def _index(reports: Iterable[RankReport], now_ts: float) -> _Job:
    by_rank = {r.rank: r for r in reports}
    at_point: dict[Point, list[int]] = defaultdict(list)
    blocked_in: dict[str, int] = {}
    for r in by_rank.values():
        if r.blocked is not None:
            at_point[(r.blocked.group, r.blocked.seq)].append(r.rank)
            blocked_in.setdefault(r.blocked.group, r.rank)
    return _Job(by_rank=by_rank, at_point=at_point, blocked_in=blocked_in, now_ts=now_ts)


def resumed(report: RankReport, *, first_step: int | None, opened_ts: float) -> bool:
    """Whether a heartbeat says progress resumed after a hang that began at `first_step`."""
    if report.kind != "heartbeat" or report.ts <= opened_ts:
        return False
    return first_step is None or (report.step is not None and report.step > first_step)


def attribute_hang(
    job_id: str,
    reports: Sequence[RankReport],
    *,
    silent_after_s: float,
    now_ts: float | None = None,
    ignore_hangs_before_ts: float | None = None,
    ignore_stalls_before_ts: float | None = None,
) -> HangState:
    """Attribute the hang the ranks' latest reports describe, if any.

    `now_ts` is the job's clock (default: its newest report); a rank is silent when its
    latest report is older than `silent_after_s`. The previous hang's end makes two kinds
    of hang report stale: those made before `ignore_hangs_before_ts` (the job's clock when
    it was closed) and those of a stall that began before `ignore_stalls_before_ts` (when
    progress resumed): a rank that lived through the closed hang (frozen, asleep) reports
    that same stall as it comes back, sometimes a moment after its peers' heartbeats that
    closed it.
    """
    if not reports:
        return HangState(False, None, [], False, _ranks_by_state(None, [], set()), None, None)
    now = now_ts if now_ts is not None else max(r.ts for r in reports)
    cutoff = ignore_hangs_before_ts if ignore_hangs_before_ts is not None else float("-inf")
    stalls_cutoff = (
        ignore_stalls_before_ts if ignore_stalls_before_ts is not None else float("-inf")
    )
    job = _index(reports, now)
    hang_ranks = sorted(
        r.rank
        for r in job.by_rank.values()
        if r.kind == "hang" and r.ts > cutoff and _last_progress(r) >= stalls_cutoff
    )
    silent = {r.rank for r in job.by_rank.values() if now - r.ts > silent_after_s}
    if not hang_ranks:
        return HangState(False, None, [], False, _ranks_by_state(job, [], silent), None, None)
    since = min(_stall_start(job.by_rank[r]) for r in hang_ranks)
    culprits, pending, explained = _walk(job, hang_ranks, silent, since, silent_after_s)
    state = HangState(
        hanging=True,
        finding=None,
        pending=pending,
        explained_by_phase=bool(explained) and not culprits,
        ranks_by_state=_ranks_by_state(job, hang_ranks, silent),
        since_ts=since,
        resumed_ts=None,
    )
    if culprits and not pending:
        state.finding = _finding(job_id, job, culprits, hang_ranks, since, state.ranks_by_state)
    return state


def _last_progress(r: RankReport) -> float:
    """When the rank last made progress: its stall began then."""
    if r.last_progress_ts is not None:
        return r.last_progress_ts
    return r.ts - (r.stalled_s or 0.0)


def _stall_start(r: RankReport) -> float:
    if r.blocked is not None and r.blocked.since_ts is not None:
        return r.blocked.since_ts
    if r.last_progress_ts is not None:
        return r.last_progress_ts
    return r.ts - (r.stalled_s or 0.0)


def _walk(
    job: _Job,
    hang_ranks: list[int],
    silent: set[int],
    since: float,
    silent_after_s: float,
) -> tuple[list[_Culprit], list[int], list[int]]:
    """Culprits, ranks still unknown, and roots explained by a declared phase."""
    roots: dict[int, list[Point]] = defaultdict(list)
    complete: list[Point] = []
    seen_points: set[Point] = set()
    queue = [r for r in hang_ranks if job.by_rank[r].blocked is not None]
    stalled_elsewhere = {r for r in hang_ranks if job.by_rank[r].blocked is None}
    if stalled_elsewhere:
        # A rank stalled outside any collective says so at its threshold; its peers, which
        # came to the next collective later, may only have sent heartbeats so far.
        for point, ranks in job.at_point.items():
            if stalled_elsewhere.intersection(job.missing(point)):
                queue.extend(r for r in ranks if r not in silent)
    visited = set(queue)
    while queue:
        blocked = job.by_rank[queue.pop()].blocked
        assert blocked is not None
        point = (blocked.group, blocked.seq)
        if point in seen_points:
            continue
        seen_points.add(point)
        missing = job.missing(point)
        if not missing:
            complete.append(point)
        for m in missing:
            report = job.by_rank.get(m)
            if (
                report is not None
                and report.blocked is not None
                and m not in silent
                and not _older_than(report, job, point)
            ):
                if m not in visited:
                    visited.add(m)
                    queue.append(m)
            else:
                roots[m].append(point)
    culprits: list[_Culprit] = []
    pending: list[int] = []
    explained: list[int] = []
    hanging = set(hang_ranks)
    for m, points in sorted(roots.items()):
        point = min(points, key=lambda p: (job.point_since(p), -len(job.at_point.get(p, ()))))
        report = job.by_rank.get(m)
        if report is None:
            if job.now_ts - since > silent_after_s:
                culprits.append(_Culprit(m, "silent", point))
            else:
                pending.append(m)
        elif m in silent:
            culprits.append(_Culprit(m, "silent", point))
        elif _older_than(report, job, point) or _moved_on_since(report, job, point):
            pending.append(m)
        elif report.phase is not None and m not in hanging:
            explained.append(m)
        else:
            culprits.append(_Culprit(m, "never_entered", point))
    if not roots:
        for point in sorted(complete):
            found = _complete_point(job, point, silent)
            if found is None:  # the last member just arrived: the collective may be completing
                pending.extend(r for r in job.at_point[point] if job.by_rank[r].kind != "hang")
            else:
                culprits.extend(found)
    return culprits, pending, explained


def _older_than(report: RankReport, job: _Job, point: Point) -> bool:
    """Whether the report was made before its peers began to wait at `point`, so it cannot
    say where the rank is now (a heartbeat sent steps ago may still show it blocked in an
    earlier collective its peers have long completed): the rank is pending until it reports
    again, or silent."""
    return report.ts < job.point_since(point)


def _moved_on_since(report: RankReport, job: _Job, point: Point) -> bool:
    """Whether the rank made progress after every report of the ranks waiting at `point`:
    they may have gone on too (a rank leaving a long phase completes the collective its
    peers waited in), so it is pending until they report again."""
    reported_ts = job.point_reported(point)
    progress_ts = report.last_progress_ts
    return reported_ts is not None and progress_ts is not None and progress_ts > reported_ts


_P2P = frozenset({"send", "recv"})


def _signature(job: _Job, rank: int) -> tuple[str, int | None]:
    """What must agree at one point: the op and payload (a send matches its recv)."""
    blocked = job.by_rank[rank].blocked
    assert blocked is not None
    return ("send/recv" if blocked.op in _P2P else blocked.op), blocked.bytes


def _complete_point(job: _Job, point: Point, silent: set[int]) -> list[_Culprit] | None:
    """Culprits at a collective every member entered: a minority signature, silent members,
    or the whole group once every member waited in it past its threshold (None before:
    a member that arrived last reports a heartbeat, and the collective may be completing)."""
    members = sorted(job.members(point[0]))
    quiet = [m for m in members if m in silent]
    if quiet:
        return [_Culprit(m, "silent", point) for m in quiet]
    blocked = sorted(job.at_point.get(point, ()))
    signatures = Counter(_signature(job, r) for r in blocked)
    if len(signatures) > 1:
        top = max(signatures.values())
        # Majority vote; a tie goes to the signature of the lowest rank.
        majority = next(
            _signature(job, r) for r in blocked if signatures[_signature(job, r)] == top
        )
        return [_Culprit(r, "mismatched", point) for r in blocked if _signature(job, r) != majority]
    if any(job.by_rank[r].kind != "hang" for r in blocked):
        return None
    if any(_completed_on(job, m, point) for m in members):
        # A member has completed it: the waiting ranks' reports predate that (a member that
        # arrived after a long wait, e.g. from a checkpoint, reports before they do again).
        return None
    return [_Culprit(m, "not_completing", point) for m in members]


def _completed_on(job: _Job, rank: int, point: Point) -> bool:
    """Whether `rank`'s latest report says the collective at `point` completed there."""
    report = job.by_rank.get(rank)
    frontier = report.frontiers.get(point[0]) if report is not None else None
    return frontier is not None and frontier.completed >= point[1]


def _finding(
    job_id: str,
    job: _Job,
    culprits: list[_Culprit],
    hang_ranks: list[int],
    since: float,
    ranks_by_state: dict[str, Any],
) -> schema.Finding:
    classes = Counter(c.hang_class for c in culprits)
    hang_class = max(schema.HANG_CLASSES, key=lambda k: (classes[k], -schema.HANG_CLASSES.index(k)))
    chosen = sorted((c for c in culprits if c.hang_class == hang_class), key=lambda c: c.rank)
    primary = chosen[0]
    group, seq = primary.point
    mesh_dim = job.mesh_dim(group)
    waiting_here = job.at_point.get(primary.point, [])
    if hang_class == "mismatched":
        ops = Counter(_signature(job, r)[0] for r in waiting_here)
        op = ",".join(sorted(ops, key=lambda o: (-ops[o], o)))
    else:
        ops = Counter(job.by_rank[r].blocked.op for r in waiting_here)  # type: ignore[union-attr]
        op = ops.most_common(1)[0][0] if ops else ""
    ranks = [c.rank for c in chosen]
    nodes = sorted({n for r in ranks if (n := _node(job, r))})
    primary_report = job.by_rank.get(primary.rank)
    majority, outliers = _merge_stacks(job, hang_ranks)
    steps = [job.by_rank[r].step for r in hang_ranks if job.by_rank[r].step is not None]
    stalled_s = max(0.0, job.now_ts - since)
    return schema.Finding(
        job_id=job_id,
        kind="hang",
        severity="critical",
        ranks=ranks,
        node=nodes[0] if len(nodes) == 1 else None,
        first_step=min(steps) if steps else None,  # type: ignore[type-var]
        metric="stalled_s",
        observed=stalled_s,
        cause=CAUSE_OF_CLASS[hang_class],
        evidence={
            "class": hang_class,
            "group": schema.group_label(group, mesh_dim),
            "group_name": group,
            "mesh_dim": mesh_dim,
            "op": op,
            "seq": seq,
            "nodes": nodes,
            "culprit_stack": _stack_doc(primary_report.stack if primary_report else None),
            "stack_source": primary_report.stack_source if primary_report else None,
            "majority_stack": majority,
            "outlier_stacks": outliers,
            "since_ts": since,
            "detection_s": stalled_s,
            "ranks_by_state": ranks_by_state,
        },
    )


def _node(job: _Job, rank: int) -> str | None:
    report = job.by_rank.get(rank)
    return report.node if report else None


def _stack_doc(stack: Stack | None) -> list[dict[str, Any]] | None:
    if stack is None:
        return None
    return [{"file": f, "line": line, "function": fn} for f, line, fn in stack]


def _merge_stacks(
    job: _Job, hang_ranks: list[int]
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """The stack most hanging ranks share, and the others with their ranks (fewest first)."""
    by_stack: dict[Stack, list[int]] = defaultdict(list)
    for r in hang_ranks:
        stack = job.by_rank[r].stack
        if stack is not None:
            by_stack[stack].append(r)
    if not by_stack:
        return None, []
    ordered = sorted(by_stack.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    majority = _stack_doc(ordered[0][0])
    outliers = [
        {"num_ranks": len(ranks), "ranks": ranks[:16], "stack": _stack_doc(stack)}
        for stack, ranks in sorted(ordered[1:], key=lambda kv: (len(kv[1]), kv[1][0]))
    ]
    return majority, outliers[:MAX_OUTLIER_STACKS]


def rank_spans(ranks: Iterable[int], max_spans: int = 200) -> str:
    """Ranks as sorted spans: "0-7,16,18-23" (cut after `max_spans`, ending in "...")."""
    spans: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            spans.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        spans.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(spans[:max_spans]) + (",..." if len(spans) > max_spans else "")


def _ranks_by_state(job: _Job | None, hang_ranks: list[int], silent: set[int]) -> dict[str, Any]:
    """Hanging ranks by what they do: waiting in which collective, elsewhere, silent."""
    waiting: dict[str, dict[str, Any]] = {}
    elsewhere: list[int] = []
    if job is not None:
        by_point: dict[tuple[str, str, int], list[int]] = defaultdict(list)
        for r in hang_ranks:
            if r in silent:
                continue
            blocked = job.by_rank[r].blocked
            if blocked is None:
                elsewhere.append(r)
            else:
                by_point[(blocked.group, blocked.op, blocked.seq)].append(r)
        for (group, op, seq), ranks in sorted(by_point.items(), key=lambda kv: -len(kv[1])):
            mesh_dim = job.mesh_dim(group)
            label = f"{schema.group_label(group, mesh_dim)} {op} #{seq}"
            if label in waiting:
                label = f"{label} ({group})"
            waiting[label] = {
                "group_name": group,
                "mesh_dim": mesh_dim,
                "op": op,
                "seq": seq,
                "num_ranks": len(ranks),
                "ranks": rank_spans(ranks),
            }
    return {
        "waiting": waiting,
        "elsewhere": sorted(elsewhere)[:MAX_LISTED_RANKS],
        "silent": sorted(silent)[:MAX_LISTED_RANKS],
        "num_elsewhere": len(elsewhere),
        "num_silent": len(silent),
    }
