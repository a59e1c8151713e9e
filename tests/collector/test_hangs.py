"""POST /v1/hangs through a real server on SQLite and PostgreSQL: reports in, the hang
finding stored (and sent to the webhooks) at once, closed when progress resumes."""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from stepscope.synthetic.hangs import DATA_STACK, Layout, heartbeats, inject, report
from tests.live_server import RunningServer, read_rows, run_server
from tests.server.webhook_receiver import Receiver, webhook_receiver

TS = 1_767_000_000.0
LAYOUT = Layout(dp=4, tp=4, pp=1)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with webhook_receiver() as running:
        yield running


@pytest.fixture
def server(db_url: str, receiver: Receiver) -> Iterator[RunningServer]:
    with run_server(db_url, extra_args=["--webhook", receiver.url]) as running:
        yield running


def send(client: httpx.Client, reports: list[dict[str, Any]]) -> None:
    """POST each report (8 at a time)."""

    def one(doc: dict[str, Any]) -> None:
        response = client.post("/v1/hangs", json=doc)
        assert response.status_code == 200, response.text
        assert response.json() == {"ok": True}

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, reports))


def settled(doc: dict[str, Any]) -> bool:
    """The server attributed every report it answered."""
    return bool(doc["attributed_at"]) and not doc["attribution_pending"]


def wait_for_hang(
    client: httpx.Client, job_id: str, done: Any, timeout_s: float = 5.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        doc = client.get(f"/api/v1/jobs/{job_id}/hang").json()
        if done(doc):
            return doc
        time.sleep(0.01)
    raise AssertionError(f"no such hang state within {timeout_s} s: {doc}")


def test_hang_is_stored_named_notified_and_closed_on_progress(
    server: RunningServer, receiver: Receiver
) -> None:
    hang = inject(
        LAYOUT, "job-h", "never_entered", 1, ts=TS + 1, step=30, base_seq=100, rng=random.Random(2)
    )
    (culprit,) = hang.culprits
    with httpx.Client(base_url=server.url, timeout=30) as client:
        send(client, heartbeats(LAYOUT, "job-h", ts=TS, step=30, base_seq=100))
        assert client.get("/api/v1/jobs/job-h/hang").json()["hang"] is None

        send(client, hang.heartbeats)
        send(client, hang.reports)
        doc = wait_for_hang(client, "job-h", settled)

        f = doc["hang"]
        assert (f["kind"], f["severity"], f["ranks"], f["first_step"], f["last_step"]) == (
            "hang",
            "critical",
            [culprit],
            30,
            None,
        )
        e = f["evidence"]
        assert (e["class"], e["group"], e["group_name"], e["op"], e["seq"]) == (
            "never_entered",
            "tp",
            hang.group,
            "all_reduce",
            101,
        )
        assert e["culprit_stack"] == DATA_STACK
        assert e["ranks_by_state"]["elsewhere"] == [culprit]
        assert doc["hanging"] is True
        assert doc["num_reports"] == 16
        (row,) = [r for r in read_rows(server.db_url, "findings", "job-h") if r["kind"] == "hang"]
        assert row["ranks"] == [culprit]
        assert len(read_rows(server.db_url, "hang_reports", "job-h")) == 16

        receiver.wait_for(lambda requests: len(requests) >= 1, timeout_s=5)
        sent = orjson.loads(receiver.requests[0].body)
        assert sent["finding"]["kind"] == "hang"
        assert sent["finding"]["ranks"] == [culprit]
        assert "hang" in sent["text"]

        # The culprit enters the collective at last: for a moment every member waits in it,
        # which is how the hang ends, not a new culprit (all four "not completing").
        seqs = {"tp": (101, 100), "dp": (100, 100), "pp": (100, 100)}
        blocked = {"group": hang.group, "op": "all_reduce", "seq": 101, "since_ts": TS + 11.5}
        entered = report(
            LAYOUT, "job-h", culprit, ts=TS + 11.6, kind="hang", step=30, seqs=seqs, blocked=blocked
        )
        send(client, [entered])
        doc = wait_for_hang(client, "job-h", settled)
        assert (doc["hang"]["ranks"], doc["hang"]["evidence"]["class"]) == (
            [culprit],
            "never_entered",
        )

        # Progress resumes: heartbeats of step 31, 20 s after the culprit stalled.
        resume = heartbeats(LAYOUT, "job-h", ts=TS + 22, step=31, base_seq=102)
        for doc_ in resume:
            doc_["last_progress_ts"] = TS + 21.0
        send(client, resume)
        doc = wait_for_hang(client, "job-h", lambda d: d["hang"] is None)
        assert doc["hanging"] is False
    (row,) = [r for r in read_rows(server.db_url, "findings", "job-h") if r["kind"] == "hang"]
    assert row["last_step"] == 31
    assert row["evidence"]["time_lost_s"] == pytest.approx(20.0)
    assert row["evidence"]["resumed_ts"] == pytest.approx(TS + 21)
    assert len(receiver.requests) == 1  # closing does not notify again


GOOD = {
    "schema": 1,
    "job_id": "job-bad",
    "rank": 3,
    "incarnation": "inc-1",
    "node": "host-a",
    "pid": 4711,
    "world_size": 16,
    "ts": TS,
    "kind": "hang",
    "step": 41,
    "section": "forward",
    "phase": None,
    "last_progress_ts": TS - 10,
    "stalled_s": 10.0,
    "blocked": {"group": "0", "op": "all_reduce", "seq": 31, "since_ts": TS - 10},
    "frontiers": [
        {
            "group": "0",
            "mesh_dim": "tp",
            "group_ranks": "0-3",
            "size": 4,
            "enqueued": 31,
            "completed": 30,
        }
    ],
    "stack": [{"file": "train.py", "line": 12, "function": "load_batch"}],
    "stack_source": "watchdog",
}


BAD_REPORTS: list[tuple[Any, int, str]] = [
    (lambda d: d.pop("job_id"), 422, "job_id"),
    (lambda d: d.__setitem__("kind", "stuck"), 422, "kind"),
    (lambda d: d.__setitem__("rank", -1), 422, "rank"),
    (lambda d: d.__setitem__("ts", "now"), 422, "ts"),
    (lambda d: d.__setitem__("schema", 2), 422, "schema"),
    (lambda d: d.__setitem__("colour", "red"), 422, "colour"),
    (lambda d: d["blocked"].pop("seq"), 422, "blocked.seq"),
    (lambda d: d["blocked"].__setitem__("op", "allreduce"), 422, "blocked.op"),
    (lambda d: d["frontiers"][0].__setitem__("enqueued", 1.5), 422, "frontiers[0].enqueued"),
    (
        lambda d: d["frontiers"][0].__setitem__("group_ranks", "a-b"),
        422,
        "frontiers[0].group_ranks",
    ),
    (lambda d: d["stack"][0].pop("function"), 422, "stack[0].function"),
    (lambda d: d.__setitem__("stack_source", "guess"), 422, "stack_source"),
]
"""(how to spoil GOOD, the status, what the message must name)."""


def test_bad_reports_are_rejected_naming_the_field_and_nothing_is_stored(
    server: RunningServer,
) -> None:
    for mutate, status, field in BAD_REPORTS:
        bad = copy.deepcopy(GOOD)
        mutate(bad)
        response = httpx.post(f"{server.url}/v1/hangs", json=bad, timeout=30)
        assert response.status_code == status, field
        assert field in response.json()["detail"]
    response = httpx.post(
        f"{server.url}/v1/hangs", content=b"{", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert read_rows(server.db_url, "hang_reports", None) == []
    good = httpx.post(f"{server.url}/v1/hangs", json=GOOD, timeout=30)
    assert good.status_code == 200, good.text
    (row,) = read_rows(server.db_url, "hang_reports", "job-bad")
    assert (row["rank"], row["kind"], row["blocked"]["seq"]) == (3, "hang", 31)


def test_a_nodes_reports_in_one_request_are_stored_together_or_not_at_all(
    server: RunningServer,
) -> None:
    node = [{**copy.deepcopy(GOOD), "job_id": "job-node", "rank": r} for r in range(8)]
    spoiled = copy.deepcopy(node)
    spoiled[5]["stack"][0].pop("function")
    response = httpx.post(f"{server.url}/v1/hangs", json=spoiled, timeout=30)
    assert response.status_code == 422
    assert response.json()["detail"].startswith("reports[5]: stack[0].function")
    assert read_rows(server.db_url, "hang_reports", "job-node") == []
    for bad, status in (([], 422), ([GOOD] * 1025, 413)):
        assert httpx.post(f"{server.url}/v1/hangs", json=bad, timeout=30).status_code == status
    assert read_rows(server.db_url, "hang_reports", None) == []
    response = httpx.post(f"{server.url}/v1/hangs", json=node, timeout=30)
    assert response.status_code == 200, response.text
    rows = read_rows(server.db_url, "hang_reports", "job-node")
    assert sorted((r["rank"], r["kind"], r["blocked"]["seq"]) for r in rows) == [
        (r, "hang", 31) for r in range(8)
    ]
