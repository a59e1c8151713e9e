"""Hang attribution on constructed reports: each class, 1-3 culprits, 16 and 1,024 ranks."""

from __future__ import annotations

import random
from typing import Any

import pytest

from stepscope.analysis.hangs.culprits import RankReport, attribute_hang, rank_spans, resumed
from stepscope.synthetic.hangs import (
    DATA_STACK,
    OTHER_OP_STACK,
    WAIT_STACK,
    Layout,
    checkpointing,
    heartbeats,
    inject,
    report,
)

TS = 1_767_000_000.0
LAYOUTS = {16: Layout(dp=4, tp=4, pp=1), 1024: Layout(dp=16, tp=8, pp=8)}


def latest(*rounds: list[dict[str, Any]]) -> list[RankReport]:
    """Each rank's latest report after these rounds."""
    by_rank: dict[int, dict[str, Any]] = {}
    for round_ in rounds:
        for doc in round_:
            by_rank[doc["rank"]] = doc
    return [RankReport.of(doc) for doc in by_rank.values()]


@pytest.mark.parametrize("world_size", [16, 1024])
@pytest.mark.parametrize("num_culprits", [1, 2, 3])
@pytest.mark.parametrize("hang_class", ["never_entered", "mismatched", "not_completing", "silent"])
def test_each_class_names_its_culprits_and_collective(
    world_size: int, num_culprits: int, hang_class: Any
) -> None:
    layout = LAYOUTS[world_size]
    rng = random.Random(world_size * 10 + num_culprits)
    base = heartbeats(layout, "j", ts=TS, step=30, base_seq=100)
    hang = inject(layout, "j", hang_class, num_culprits, ts=TS + 1, step=30, base_seq=100, rng=rng)

    state = attribute_hang("j", latest(base, hang.reports), silent_after_s=6.0)

    f = state.finding
    assert f is not None
    assert (f.kind, f.severity, f.metric) == ("hang", "critical", "stalled_s")
    assert f.ranks == hang.culprits
    assert f.evidence["class"] == hang_class
    assert (f.evidence["group_name"], f.evidence["op"], f.evidence["seq"]) == (
        hang.group,
        hang.op,
        101,
    )
    assert f.evidence["group"] == "tp"
    assert f.evidence["mesh_dim"] == "tp"
    assert f.cause == ("communication" if hang_class == "not_completing" else "host")
    assert f.first_step == 30
    # The first stall: the culprit's last progress, or its peers' entering the collective.
    since = TS + 1 if hang_class == "never_entered" else TS + 1.1
    assert f.evidence["since_ts"] == pytest.approx(since)
    assert f.observed == pytest.approx(max(r["ts"] for r in hang.reports) - since)
    if len({layout.node(r) for r in hang.culprits}) == 1:
        assert f.node == layout.node(hang.culprits[0])
    assert f.evidence["majority_stack"] == WAIT_STACK
    by_state = f.evidence["ranks_by_state"]
    if hang_class == "never_entered":
        assert f.evidence["culprit_stack"] == DATA_STACK
        assert by_state["elsewhere"] == hang.culprits
        assert [o["ranks"] for o in f.evidence["outlier_stacks"]] == [hang.culprits]
    if hang_class == "mismatched":
        assert f.evidence["culprit_stack"] == OTHER_OP_STACK
    if hang_class == "silent":
        assert f.evidence["culprit_stack"] is None
        assert by_state["silent"] == hang.culprits
    waiting_ranks = sum(w["num_ranks"] for w in by_state["waiting"].values())
    expected_waiting = world_size - num_culprits * (hang_class in ("never_entered", "silent"))
    assert waiting_ranks == expected_waiting


def test_a_culprit_not_heard_from_since_its_peers_blocked_is_pending() -> None:
    layout = LAYOUTS[16]
    base = heartbeats(layout, "j", ts=TS, step=30, base_seq=100)
    hang = inject(
        layout, "j", "never_entered", 1, ts=TS + 1, step=30, base_seq=100, rng=random.Random(3)
    )
    (culprit,) = hang.culprits
    others = [r for r in hang.reports if r["rank"] != culprit]

    state = attribute_hang("j", latest(base, others), silent_after_s=60.0)

    assert state.hanging
    assert state.finding is None
    assert state.pending == [culprit]


def test_a_heartbeat_from_steps_ago_showing_an_earlier_collective_is_stale() -> None:
    # A rank's last heartbeat caught it in the all_reduce of step 18 (seq 19); it then ran to
    # step 24 between heartbeats and froze before sending another, while its peers block in
    # seq 25. The old heartbeat says nothing of now: pending, then silent; never "every rank
    # stuck in seq 19", which its peers completed long ago.
    layout = Layout(dp=4, tp=1, pp=1)
    frozen, seqs = 3, {"tp": (25, 24), "dp": (25, 24), "pp": (25, 24)}
    blocked = {"group": layout.dp_group(0), "op": "all_reduce", "seq": 25, "since_ts": TS + 0.2}
    peers = [
        report(layout, "j", r, ts=TS + 2.2, kind="hang", step=24, seqs=seqs, blocked=blocked)
        for r in range(3)
    ]
    old = dict.fromkeys(("tp", "dp", "pp"), (19, 18))
    in_seq_19 = {**blocked, "seq": 19, "since_ts": TS - 0.01}
    last = report(
        layout, "j", frozen, ts=TS, kind="heartbeat", step=18, seqs=old, blocked=in_seq_19
    )

    state = attribute_hang("j", latest([last], peers), silent_after_s=4.0)
    assert state.hanging
    assert (state.finding, state.pending) == (None, [frozen])

    later = attribute_hang("j", latest([last], peers), silent_after_s=4.0, now_ts=TS + 4.5)
    assert later.finding is not None
    assert (later.finding.ranks, later.finding.evidence["class"]) == ([frozen], "silent")
    assert later.finding.evidence["seq"] == 25


def test_the_last_member_arriving_is_not_a_collective_that_does_not_complete() -> None:
    # Three ranks waited 6 s in seq 9 for a rank in a checkpoint; it arrives, and its
    # heartbeat shows it in seq 9 too: the collective is completing, not stuck (yet).
    layout = Layout(dp=4, tp=1, pp=1)
    seqs = {"tp": (9, 8), "dp": (9, 8), "pp": (9, 8)}
    blocked = {"group": layout.dp_group(0), "op": "all_reduce", "seq": 9, "since_ts": TS}
    waited = [
        report(layout, "j", r, ts=TS + 6, kind="hang", step=8, seqs=seqs, blocked=blocked)
        for r in range(1, 4)
    ]
    arrived = {**blocked, "since_ts": TS + 6.0}
    beat = report(layout, "j", 0, ts=TS + 6.1, kind="heartbeat", step=8, seqs=seqs, blocked=arrived)

    state = attribute_hang("j", latest(waited, [beat]), silent_after_s=4.0)
    assert (state.finding, state.pending) == (None, [0])

    # It stays there past its own threshold: every member waits, the collective is stuck.
    stuck = {**beat, "kind": "hang", "ts": TS + 8.1}
    later = attribute_hang("j", latest(waited, [stuck]), silent_after_s=4.0)
    assert later.finding is not None
    assert (later.finding.ranks, later.finding.evidence["class"]) == (
        [0, 1, 2, 3],
        "not_completing",
    )


def test_a_rank_stalled_past_its_threshold_is_named_before_its_peers_report() -> None:
    # Rank 2 stalls in its data loader; its peers reached the all_reduce a second later, so
    # when rank 2 reports its hang they have only sent heartbeats showing them waiting.
    layout = Layout(dp=4, tp=1, pp=1)
    seqs = {"tp": (11, 10), "dp": (11, 10), "pp": (11, 10)}
    blocked = {"group": layout.dp_group(0), "op": "all_reduce", "seq": 11, "since_ts": TS + 1}
    waiting = [
        report(layout, "j", r, ts=TS + 1.5, kind="heartbeat", step=10, seqs=seqs, blocked=blocked)
        for r in (0, 1, 3)
    ]
    before = dict.fromkeys(("tp", "dp", "pp"), (10, 10))
    stalled = report(
        layout,
        "j",
        2,
        ts=TS + 2.1,
        kind="hang",
        step=10,
        seqs=before,
        stack=DATA_STACK,
        stalled_s=2.1,
    )

    state = attribute_hang("j", latest(waiting, [stalled]), silent_after_s=6.0)
    f = state.finding
    assert f is not None
    assert (f.ranks, f.evidence["class"], f.evidence["op"], f.evidence["seq"]) == (
        [2],
        "never_entered",
        "all_reduce",
        11,
    )
    assert f.evidence["since_ts"] == pytest.approx(TS)
    # Without a rank past its threshold, heartbeats of ranks waiting are no hang.
    assert not attribute_hang("j", latest(waiting), silent_after_s=6.0).hanging


def test_checkpoint_phase_explains_the_wait() -> None:
    layout = LAYOUTS[1024]
    base = heartbeats(layout, "j", ts=TS, step=30, base_seq=100)

    state = attribute_hang(
        "j",
        latest(base, checkpointing(layout, "j", ts=TS + 1, step=30, base_seq=100)),
        silent_after_s=6.0,
    )

    assert state.hanging
    assert state.explained_by_phase
    assert state.finding is None


def test_a_rank_leaving_its_phase_is_no_culprit_until_its_peers_report_again() -> None:
    # Rank 0 ends its checkpoint and reports at once, without the phase; its peers' latest
    # reports still show them in the barrier it has just completed.
    layout = LAYOUTS[16]
    base = heartbeats(layout, "j", ts=TS, step=30, base_seq=100)
    waiting = checkpointing(layout, "j", ts=TS + 1, step=30, base_seq=100)
    seqs = dict.fromkeys(("tp", "dp", "pp", "world"), (100, 100))
    left = report(layout, "j", 0, ts=TS + 31.5, kind="heartbeat", step=31, seqs=seqs)

    state = attribute_hang("j", latest(base, waiting, [left]), silent_after_s=6.0)

    assert state.finding is None
    assert state.pending == [0]
    # Peers still blocked there after rank 0's progress: rank 0 never entered it.
    again = [{**doc, "ts": TS + 32.0} for doc in waiting if doc["rank"] != 0]
    state = attribute_hang("j", latest(base, waiting, [left], again), silent_after_s=6.0)
    assert state.finding is not None
    assert state.finding.ranks == [0]
    assert state.finding.evidence["class"] == "never_entered"


def test_clean_job_has_no_hang() -> None:
    layout = LAYOUTS[1024]
    reports = heartbeats(layout, "j", ts=TS, step=30, base_seq=100)
    seqs = dict.fromkeys(("tp", "dp", "pp"), (101, 100))
    # A rank momentarily inside a collective says so in its heartbeat.
    reports[5] = report(
        layout,
        "j",
        5,
        ts=TS,
        kind="heartbeat",
        step=30,
        seqs=seqs,
        blocked={"group": layout.tp_group(5), "op": "all_reduce", "seq": 101, "since_ts": TS},
    )

    state = attribute_hang("j", latest(reports), silent_after_s=6.0)

    assert not state.hanging
    assert state.finding is None


def test_stale_hang_reports_after_the_hang_ended_are_ignored() -> None:
    layout = LAYOUTS[16]
    base = heartbeats(layout, "j", ts=TS, step=30, base_seq=100)
    hang = inject(layout, "j", "silent", 1, ts=TS + 1, step=30, base_seq=100, rng=random.Random(1))
    end = max(r["ts"] for r in hang.reports)

    state = attribute_hang(
        "j", latest(base, hang.reports), silent_after_s=6.0, ignore_hangs_before_ts=end
    )

    assert not state.hanging


def test_a_stall_that_began_before_the_hang_ended_is_that_hangs() -> None:
    # Rank 3 froze at step 24 (its last progress TS); progress resumed at TS + 10.25 and its
    # peers' heartbeats of step 25 closed the hang (the job's clock TS + 10.3). Its watchdog,
    # thawed, looked before its training thread moved on: its report of that stall is made
    # after the heartbeats, while its peers wait for it in the next all_reduce.
    layout = Layout(dp=4, tp=1, pp=1)
    blocked = {"group": layout.dp_group(0), "op": "all_reduce", "seq": 26, "since_ts": TS + 10.25}
    peers = [
        report(
            layout,
            "j",
            r,
            ts=TS + 10.3,
            kind="heartbeat",
            step=25,
            seqs=dict.fromkeys(("tp", "dp", "pp"), (26, 25)),
            blocked=blocked,
            stalled_s=0.05,
        )
        for r in range(3)
    ]
    old = dict.fromkeys(("tp", "dp", "pp"), (24, 24))
    thawed = report(
        layout,
        "j",
        3,
        ts=TS + 10.4,
        kind="hang",
        step=24,
        seqs=old,
        stack=DATA_STACK,
        stalled_s=10.4,
    )
    ended = {"ignore_hangs_before_ts": TS + 10.3, "ignore_stalls_before_ts": TS + 10.25}

    state = attribute_hang("j", latest(peers, [thawed]), silent_after_s=4.0, **ended)

    assert not state.hanging
    assert state.finding is None

    # A stall that began after progress resumed is a new hang, named once its peers wait.
    again = {**thawed, "ts": TS + 12.5, "last_progress_ts": TS + 10.3, "stalled_s": 2.2}
    waiting = [{**p, "ts": TS + 12.6, "kind": "hang", "stalled_s": 2.35} for p in peers]
    state = attribute_hang("j", latest(waiting, [again]), silent_after_s=4.0, **ended)

    assert state.finding is not None
    assert (state.finding.ranks, state.finding.evidence["class"]) == ([3], "never_entered")


def test_resumed_needs_a_later_heartbeat_past_the_hung_step() -> None:
    layout = LAYOUTS[16]
    seqs = dict.fromkeys(("tp", "dp", "pp"), (100, 100))
    later = RankReport.of(report(layout, "j", 1, ts=TS + 20, kind="heartbeat", step=31, seqs=seqs))
    same = RankReport.of(report(layout, "j", 1, ts=TS + 20, kind="heartbeat", step=30, seqs=seqs))
    assert resumed(later, first_step=30, opened_ts=TS + 10)
    assert not resumed(same, first_step=30, opened_ts=TS + 10)
    assert not resumed(later, first_step=30, opened_ts=TS + 30)


def test_rank_spans_are_sorted_runs() -> None:
    assert rank_spans([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert rank_spans(range(0, 10, 2), max_spans=2) == "0,2,..."


def _pipeline_report(
    rank: int, kind: str, blocked: dict[str, Any] | None, frontiers: list[dict[str, Any]]
) -> RankReport:
    return RankReport.of(
        {
            "rank": rank,
            "ts": TS + 5,
            "kind": kind,
            "step": 8,
            "blocked": blocked,
            "frontiers": frontiers,
            "stack": DATA_STACK if blocked is None else WAIT_STACK,
        }
    )


def _channel(name: str, ranks: str, enqueued: int, completed: int) -> dict[str, Any]:
    return {
        "group": name,
        "mesh_dim": "pp",
        "group_ranks": ranks,
        "size": 2,
        "enqueued": enqueued,
        "completed": completed,
    }


def test_a_recv_waits_for_the_sender_on_its_channel() -> None:
    # 3 stages: stage 1 stalled before its 9th send to stage 2 and its 9th recv of gradients
    # from it; stage 2 waits in that recv, stage 0 in its recv of stage 1's 9th gradient.
    forward = lambda e, c: _channel("0:1>2", "1-2", e, c)  # noqa: E731
    backward = lambda e, c: _channel("0:1>0", "0-1", e, c)  # noqa: E731
    recv = {"op": "recv", "seq": 9, "since_ts": TS + 1, "bytes": 64}
    reports = [
        _pipeline_report(0, "hang", {"group": "0:1>0", **recv}, [backward(9, 8)]),
        _pipeline_report(1, "hang", None, [forward(8, 8), backward(8, 8)]),
        _pipeline_report(2, "hang", {"group": "0:1>2", **recv}, [forward(9, 8)]),
    ]
    f = attribute_hang("p", reports, silent_after_s=6.0).finding
    assert f is not None
    assert f.ranks == [1]
    assert f.evidence["class"] == "never_entered"
    assert f.evidence["group"] == "pp"
    assert (f.evidence["op"], f.evidence["seq"]) == ("recv", 9)
    assert f.evidence["group_name"] in ("0:1>0", "0:1>2")


def test_a_send_and_its_recv_stuck_together_are_not_a_mismatch() -> None:
    send = {"group": "0:0>1", "op": "send", "seq": 4, "since_ts": TS + 1, "bytes": 64}
    recv = {**send, "op": "recv"}
    channel = [_channel("0:0>1", "0-1", 4, 3)]
    reports = [
        _pipeline_report(0, "hang", send, channel),
        _pipeline_report(1, "hang", recv, channel),
    ]
    f = attribute_hang("p", reports, silent_after_s=6.0).finding
    assert f is not None
    assert f.evidence["class"] == "not_completing"
    assert f.ranks == [0, 1]


def test_a_collective_a_member_completed_is_not_named_not_completing() -> None:
    # Rank 0 came back from a long checkpoint, entered the all_reduce its peers waited in and
    # completed it; its peers' last reports, from before that, still say they wait in it.
    def world(enqueued: int, completed: int) -> dict[str, Any]:
        return {
            "group": "0",
            "group_ranks": "0-3",
            "size": 4,
            "enqueued": enqueued,
            "completed": completed,
        }

    waiting = {"group": "0", "op": "all_reduce", "seq": 9, "since_ts": TS + 1, "bytes": 256}
    reports = [
        RankReport.of(
            {
                "rank": r,
                "ts": TS + 60,
                "kind": "hang",
                "step": 8,
                "blocked": waiting,
                "frontiers": [world(9, 8)],
                "stack": WAIT_STACK,
            }
        )
        for r in (1, 2, 3)
    ]
    arrived = {"rank": 0, "ts": TS + 61, "kind": "heartbeat", "step": 8, "blocked": None}
    state = attribute_hang(
        "j",
        [*reports, RankReport.of({**arrived, "frontiers": [world(9, 9)]})],
        silent_after_s=6.0,
        now_ts=TS + 61,
    )
    assert state.hanging
    assert state.finding is None
    # Had rank 0 entered but not completed it, the whole group would be named.
    state = attribute_hang(
        "j",
        [
            *reports,
            RankReport.of(
                {**arrived, "kind": "hang", "blocked": waiting, "frontiers": [world(9, 8)]}
            ),
        ],
        silent_after_s=6.0,
        now_ts=TS + 61,
    )
    assert state.finding is not None
    assert state.finding.evidence["class"] == "not_completing"
    assert state.finding.ranks == [0, 1, 2, 3]
