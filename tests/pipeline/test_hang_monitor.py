"""The hang monitor on SQLite and PostgreSQL: one stall of one rank is one hang finding, from
its first report to the heartbeats that close it, whatever that rank reports as it comes back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from stepscope.collector.hangs import parse_report
from stepscope.pipeline.hang_monitor import HangMonitor
from stepscope.store import hang_reports
from stepscope.store.engine import make_engine
from stepscope.synthetic.hangs import DATA_STACK, WAIT_STACK, Layout, report

TS = 1_767_000_000.0
LAYOUT = Layout(dp=4, tp=1, pp=1)
"""Four ranks, one group: the step's all_reduce #(step + 1)."""
GROUP = LAYOUT.dp_group(0)
CULPRIT = 3
STEP = 24
SILENT_AFTER_S = 4.0


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def monitor(engine: sa.Engine) -> Iterator[HangMonitor]:
    running = HangMonitor(engine, silent_after_s=SILENT_AFTER_S, debounce_s=0.0)
    yield running
    running.close()


def send(monitor: HangMonitor, *docs: dict[str, Any]) -> None:
    """Store reports as POST /v1/hangs does, and wait until an attribution has seen them."""
    rows = [parse_report(doc, received_at=time.time()) for doc in docs]
    monitor.submit(rows).result(timeout=30)
    deadline = time.monotonic() + 30
    while monitor.pending("j") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not monitor.pending("j")


def stored(engine: sa.Engine) -> list[hang_reports.StoredHang]:
    with engine.connect() as conn:
        return hang_reports.hang_findings(conn, "j")


def seqs(enqueued: int, completed: int) -> dict[str, tuple[int, int]]:
    return dict.fromkeys(("tp", "dp", "pp"), (enqueued, completed))


def peer(rank: int, *, ts: float, kind: str, step: int, since_ts: float) -> dict[str, Any]:
    """A peer waiting in the step's all_reduce since `since_ts`."""
    seq = step + 1
    blocked = {"group": GROUP, "op": "all_reduce", "seq": seq, "since_ts": since_ts}
    return report(
        LAYOUT,
        "j",
        rank,
        ts=ts,
        kind=kind,
        step=step,
        seqs=seqs(seq, seq - 1),
        blocked=blocked,
        stack=WAIT_STACK if kind == "hang" else None,
        stalled_s=ts - since_ts,
    )


def culprit(*, ts: float, kind: str, stalled_s: float) -> dict[str, Any]:
    """The culprit, stalled before the step's all_reduce."""
    return report(
        LAYOUT,
        "j",
        CULPRIT,
        ts=ts,
        kind=kind,
        step=STEP,
        seqs=seqs(STEP, STEP),
        stack=DATA_STACK if kind == "hang" else None,
        stalled_s=stalled_s,
    )


def peers(*, ts: float, kind: str, step: int = STEP, since_ts: float) -> list[dict[str, Any]]:
    return [peer(r, ts=ts, kind=kind, step=step, since_ts=since_ts) for r in range(3)]


@pytest.mark.parametrize("how", ["stopped", "late"])
def test_a_rank_that_comes_back_after_the_hang_closed_is_not_a_second_hang(
    engine: sa.Engine, monitor: HangMonitor, how: str
) -> None:
    # The culprit stalls at TS ("stopped": SIGSTOP, it sends nothing; "late": asleep in its
    # data loader, it reports the hang itself); its peers block in all_reduce #25 at once.
    send(monitor, *peers(ts=TS - 0.5, kind="heartbeat", step=STEP - 1, since_ts=TS - 0.6))
    send(monitor, culprit(ts=TS - 0.01, kind="heartbeat", stalled_s=0.0))
    if how == "late":
        send(monitor, culprit(ts=TS + 2.2, kind="hang", stalled_s=2.21))
    send(monitor, *peers(ts=TS + 2.3, kind="hang", since_ts=TS + 0.05))
    send(monitor, *peers(ts=TS + 4.6, kind="hang", since_ts=TS + 0.05))
    [opened] = stored(engine)
    assert opened.finding.ranks == [CULPRIT]
    assert opened.finding.evidence["class"] == ("silent" if how == "stopped" else "never_entered")

    # It resumes at TS + 10; its peers complete all_reduce #25 and report step 25 first, and
    # wait in #26 (for it) when they do: that closes the hang.
    send(monitor, *peers(ts=TS + 10.3, kind="heartbeat", step=STEP + 1, since_ts=TS + 10.25))
    [closed] = stored(engine)
    assert closed.finding.evidence["closed_at"] is not None
    # Its watchdog had looked before its training thread moved on: its report of the stall it
    # lived through, made after its peers' heartbeats, arrives now.
    send(monitor, culprit(ts=TS + 10.4, kind="hang", stalled_s=10.41))
    send(monitor, *peers(ts=TS + 10.9, kind="heartbeat", step=STEP + 1, since_ts=TS + 10.25))

    [after] = stored(engine)
    assert after.id == opened.id
    assert after.finding.evidence["class"] == opened.finding.evidence["class"]
    # From the first stall to the peers' progress (their heartbeats' last progress).
    assert after.finding.evidence["time_lost_s"] == pytest.approx(10.2, abs=0.1)


def test_a_rank_that_never_enters_is_one_hang_however_often_it_is_attributed(
    engine: sa.Engine, monitor: HangMonitor
) -> None:
    send(monitor, *peers(ts=TS - 0.5, kind="heartbeat", step=STEP - 1, since_ts=TS - 0.6))
    for i in range(10):
        ts = TS + 2.2 + i
        send(monitor, culprit(ts=ts, kind="hang", stalled_s=ts - TS))
        send(monitor, *peers(ts=ts + 0.1, kind="hang", since_ts=TS + 0.05))
    [found] = stored(engine)
    assert (found.finding.ranks, found.finding.first_step) == ([CULPRIT], STEP)
    assert found.finding.evidence["class"] == "never_entered"
    assert found.finding.evidence.get("closed_at") is None


def test_a_new_stall_after_the_hang_closed_is_a_new_hang(
    engine: sa.Engine, monitor: HangMonitor
) -> None:
    send(monitor, *peers(ts=TS - 0.5, kind="heartbeat", step=STEP - 1, since_ts=TS - 0.6))
    send(monitor, culprit(ts=TS + 2.2, kind="hang", stalled_s=2.21))
    send(monitor, *peers(ts=TS + 2.3, kind="hang", since_ts=TS + 0.05))
    send(monitor, *peers(ts=TS + 10.3, kind="heartbeat", step=STEP + 1, since_ts=TS + 10.25))
    # The culprit made progress at TS + 10.2 (all_reduce #25) and stalls again before #26.
    again = culprit(ts=TS + 12.5, kind="hang", stalled_s=2.3)
    again["frontiers"] = LAYOUT.frontiers(CULPRIT, seqs(STEP + 1, STEP + 1))
    again["step"] = STEP + 1
    send(monitor, again)
    send(monitor, *peers(ts=TS + 12.6, kind="hang", step=STEP + 1, since_ts=TS + 10.25))

    first, second = stored(engine)
    assert first.finding.evidence["closed_at"] is not None
    assert (second.finding.ranks, second.finding.first_step) == ([CULPRIT], STEP + 1)
    assert second.finding.evidence["class"] == "never_entered"
    assert second.finding.evidence["seq"] == STEP + 2
