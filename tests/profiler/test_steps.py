"""How one step's marks become a steps row and collectives rows (CPU clock, crafted marks)."""

from __future__ import annotations

import pytest

from stepscope.profiler.collectives.calls import CollectiveCall
from stepscope.profiler.collectives.groups import GroupInfo
from stepscope.profiler.loop.steps import StepRecord
from stepscope.profiler.timer import CpuClock, union_s

CLOCK = CpuClock()
WORLD = GroupInfo(name="0", size=4, ranks="0-3")
PAIR = GroupInfo(name="3", size=2, ranks="0-2:2")
TP = {"3": "tp"}


def bucket(ready_s: float, done_s: float, num_bytes: int = 1000) -> CollectiveCall:
    return CollectiveCall(
        op="all_reduce",
        group=WORLD,
        num_bytes=num_bytes,
        start=ready_s,
        end=done_s,
        ddp_bucket=True,
    )


def test_union_of_overlapping_intervals() -> None:
    assert union_s([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert union_s([]) == 0.0


def test_fast_rank_waits_from_its_last_ready_bucket_to_the_last_completion() -> None:
    # Backward compute ends at 0.30 s; its all-reduces complete only at 0.80 s (a slow peer).
    record = StepRecord(step=3, ts=1.7e9, base=0.0, step_s=0.85, data_s=0.02)
    record.calls = [bucket(0.10, 0.80), bucket(0.30, 0.80)]
    row, collectives = record.to_rows(CLOCK, TP)
    assert row["comm_wait_s"] == pytest.approx(0.50)
    assert row["comm_s"] == pytest.approx(0.70)
    assert row["compute_s"] == pytest.approx(0.85 - 0.02 - 0.50)
    assert collectives == [
        {
            "step": 3,
            "group": "0",
            "op": "all_reduce",
            "group_size": 4,
            "count": 2,
            "bytes": 2000,
            "busy_s": pytest.approx(0.70 + 0.50),
            "wait_s": pytest.approx(0.50),
            "first_seq": None,
            "mesh_dim": None,
            "group_ranks": "0-3",
        }
    ]


def test_slow_rank_barely_waits_because_its_peers_waited_for_it() -> None:
    record = StepRecord(step=3, ts=1.7e9, base=0.0, step_s=0.85)
    record.calls = [bucket(0.10, 0.79), bucket(0.78, 0.80)]
    row, _ = record.to_rows(CLOCK, TP)
    assert row["comm_wait_s"] == pytest.approx(0.02)


def test_only_the_time_spent_in_waits_is_exposed_and_rows_are_per_group_and_op() -> None:
    record = StepRecord(step=0, ts=1.7e9, base=0.0, step_s=1.0)
    record.calls = [
        # A synchronous all-gather: waited on from issue to completion.
        CollectiveCall(
            op="all_gather",
            group=PAIR,
            num_bytes=64,
            start=0.1,
            end=0.2,
            seq=7,
            wait_s=0.1,
        ),
        # An async one, overlapped with compute, waited on for its last 0.05 s.
        CollectiveCall(
            op="all_gather",
            group=PAIR,
            num_bytes=64,
            start=0.5,
            end=0.9,
            seq=8,
            wait_s=0.05,
        ),
        CollectiveCall(op="all_reduce", group=WORLD, num_bytes=16, start=0.3, end=0.4, seq=2),
    ]
    row, rows = record.to_rows(CLOCK, TP)
    assert row["comm_wait_s"] == pytest.approx(0.15)
    assert row["comm_s"] == pytest.approx(0.6)
    by_key = {(r["group"], r["op"]): r for r in rows}
    gather = by_key[("3", "all_gather")]
    assert (gather["count"], gather["bytes"], gather["busy_s"]) == (2, 128, pytest.approx(0.5))
    assert (gather["wait_s"], gather["first_seq"]) == (pytest.approx(0.15), 7)
    assert (gather["mesh_dim"], gather["group_ranks"], gather["group_size"]) == ("tp", "0-2:2", 2)
    reduce = by_key[("0", "all_reduce")]
    assert (reduce["wait_s"], reduce["first_seq"], reduce["mesh_dim"]) == (0.0, 2, None)


def test_sections_sum_repeats_and_unknown_names_become_custom_values() -> None:
    record = StepRecord(step=0, ts=1.7e9, base=0.0, step_s=1.0)
    record.spans = [("forward", 0.0, 0.1), ("loss_scaling", 0.2, 0.25), ("forward", 0.5, 0.6)]
    row, collectives = record.to_rows(CLOCK, TP)
    assert row["forward_s"] == pytest.approx(0.2)
    assert "backward_s" not in row
    assert "comm_wait_s" not in row
    assert row["compute_s"] == pytest.approx(1.0)
    assert record.custom == {"loss_scaling_s": pytest.approx(0.05)}
    assert collectives == []


def test_a_collective_still_in_flight_keeps_the_step_unresolved() -> None:
    record = StepRecord(step=0, ts=1.7e9, base=0.0)
    call = CollectiveCall(op="broadcast", group=PAIR, num_bytes=8, start=0.1)
    record.calls = [call]
    assert not record.is_resolved(CLOCK)
    call.end = 0.2
    assert record.is_resolved(CLOCK)


class _Tick:
    """A device clock's mark: when it happens, and whether it has happened yet."""

    def __init__(self, at_s: float, *, ready: bool = True) -> None:
        self.at_s = at_s
        self.ready = ready


class _TickClock:
    """A clock whose marks are objects resolved later, as CUDA events are."""

    name = "tick"

    def is_ready(self, mark: _Tick) -> bool:
        return mark.ready

    def seconds_between(self, start: _Tick, end: _Tick) -> float:
        return end.at_s - start.at_s

    def wait(self, mark: _Tick) -> None:
        return None


WAITS = {0: [(0.1, 0.2)], 2: [(0.85, 0.88), (0.89, 0.9)]}
"""The spans waited for each call of _mixed_step, by its index."""


def _mixed_step() -> StepRecord:
    """Sections, DDP's buckets and other collectives in two groups (CPU marks: floats; a
    call's waits summed in its wait_s, from WAITS)."""
    record = StepRecord(step=5, ts=1.7e9, base=0.0, step_s=1.0, data_s=0.05)
    record.spans = [("forward", 0.05, 0.3), ("backward", 0.3, 0.7), ("optimizer", 0.8, 0.9)]
    record.calls = [
        CollectiveCall("all_gather", PAIR, 64, 0.1, 0.2, 7),
        bucket(0.4, 0.75),
        CollectiveCall("all_gather", PAIR, 64, 0.5, 0.9, 8),
        bucket(0.6, 0.78),
        CollectiveCall("all_reduce", WORLD, 16, 0.3, 0.4, 2),
    ]
    for index, waits in WAITS.items():
        record.calls[index].wait_s = sum(end - start for start, end in waits)
    return record


def _on_ticks(record: StepRecord, *, unready_end_of: int | None = None) -> StepRecord:
    """The same step on the tick clock (its waits as spans, from WAITS); the end of call
    `unready_end_of` not yet happened."""
    ticked = StepRecord(step=record.step, ts=record.ts, base=_Tick(record.base))
    ticked.step_s, ticked.data_s = record.step_s, record.data_s
    ticked.spans = [(name, _Tick(start), _Tick(end)) for name, start, end in record.spans]
    for index, call in enumerate(record.calls):
        waits = [(_Tick(s), _Tick(e)) for s, e in WAITS[index]] if index in WAITS else None
        end = _Tick(call.end, ready=index != unready_end_of)
        ticked.calls.append(
            CollectiveCall(
                call.op, call.group, call.num_bytes, _Tick(call.start), end, call.seq, waits,
                call.ddp_bucket,
            )
        )  # fmt: skip
    return ticked


def test_a_device_clock_gives_the_rows_the_cpu_clock_gives() -> None:
    record = _mixed_step()
    row, rows = record.to_rows(CLOCK, TP)
    # Waits 0.1 + 0.03 + 0.01; DDP: last ready 0.6 to last done 0.78. In flight: 0.1-0.2, 0.3-0.9.
    assert (row["comm_wait_s"], row["comm_s"]) == (pytest.approx(0.14 + 0.18), pytest.approx(0.7))
    reduce = next(r for r in rows if r["group"] == "0")
    assert (reduce["count"], reduce["bytes"], reduce["first_seq"]) == (3, 2016, 2)
    assert (reduce["busy_s"], reduce["wait_s"]) == (pytest.approx(0.63), pytest.approx(0.18))
    assert _on_ticks(record).to_rows(_TickClock(), TP) == (row, rows)


def test_a_device_mark_not_yet_happened_leaves_its_collective_out() -> None:
    ticked = _on_ticks(_mixed_step(), unready_end_of=4)  # the WORLD all-reduce
    assert not ticked.is_resolved(_TickClock())
    assert _on_ticks(_mixed_step()).is_resolved(_TickClock())
    row, rows = ticked.to_rows(_TickClock(), TP)
    assert {(r["group"], r["op"]) for r in rows} == {("3", "all_gather"), ("0", "all_reduce")}
    reduce = next(r for r in rows if r["group"] == "0")
    assert (reduce["count"], reduce["bytes"], reduce["wait_s"]) == (2, 2000, pytest.approx(0.18))
    assert reduce["first_seq"] is None
    assert row["forward_s"] == pytest.approx(0.25)
