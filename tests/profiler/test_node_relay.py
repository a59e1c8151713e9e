"""`stepscope run`'s node relay: the ranks of a node post to it, it sends their batches to the
collector in one request, and each rank gets the collector's answer for its own batch."""

from __future__ import annotations

import gzip
import json
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepscope.profiler.launch.launcher import launch
from stepscope.profiler.shipping.node_relay import NodeRelay
from stepscope.profiler.shipping.shipper import node_slot_wait_s
from stepscope.profiler.shipping.transport import Poster
from tests.collector.test_ingest import make_batch
from tests.live_server import RunningServer, free_port, post_batch, read_rows, run_server
from tests.profiler.http_sink import http_sink
from tests.profiler.test_shipper import build, step_row


@pytest.fixture
def relay(live_server: RunningServer) -> Iterator[NodeRelay]:
    """A relay that sends a bundle once 4 batches are in (or after 30 s)."""
    node_relay = NodeRelay(live_server.url, window_s=30.0, max_bundle_batches=4)
    node_relay.start()
    yield node_relay
    node_relay.stop()


def post_together(url: str, batches: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """POST each batch (gzipped, as a shipper does) from a thread of its own; the answers."""
    answers: list[tuple[int, dict[str, Any]]] = [(0, {})] * len(batches)

    def post(i: int) -> None:
        request = urllib.request.Request(
            url + "/v1/ingest",
            data=gzip.compress(json.dumps(batches[i]).encode()),
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                answers[i] = (response.status, json.loads(response.read()))
        except urllib.error.HTTPError as exc:
            answers[i] = (exc.code, {**json.loads(exc.read()), "retry": exc.headers["Retry-After"]})

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def test_a_node_s_batches_go_in_one_request_and_each_rank_hears_its_own_answer(
    live_server: RunningServer, relay: NodeRelay
) -> None:
    bad = make_batch(rank=2)
    bad["collectives"]["op"][0] = "allreduce"
    post_batch(live_server.url, make_batch(rank=3))
    batches = [make_batch(rank=0), make_batch(rank=1), bad, make_batch(rank=3)]
    answers = post_together(relay.url, batches)
    accepted = {"steps": 3, "collectives": 2, "gpu": 2, "events": 1}
    assert answers == [
        (200, {"accepted": accepted, "duplicate": False}),
        (200, {"accepted": accepted, "duplicate": False}),
        (422, {"detail": "collectives.op has unknown op(s): allreduce", "retry": None}),
        (200, {"accepted": accepted, "duplicate": True}),  # a resend
    ]
    assert (relay.stats.num_batches, relay.stats.num_requests) == (4, 1)
    steps = read_rows(live_server.db_url, "steps", "job-a")
    assert sorted((r["rank"], r["step"]) for r in steps) == [
        (rank, step) for rank in (0, 1, 3) for step in (10, 11, 12)
    ]


def test_the_collector_s_answer_to_the_whole_request_reaches_every_rank() -> None:
    with http_sink() as sink:
        sink.statuses, sink.retry_after = [503], "7"
        relay = NodeRelay(sink.url, window_s=30.0, max_bundle_batches=3)
        relay.start()
        answers = post_together(relay.url, [make_batch(rank=r) for r in range(3)])
        relay.stop()
    assert [(status, answer["retry"]) for status, answer in answers] == [(503, "7")] * 3
    assert relay.stats.num_requests == 1


def test_no_batch_fails_for_sharing_a_request_with_another() -> None:
    """A body that is not strict JSON goes alone; a bundle the collector refuses whole for its
    size (413 here: 3,000 bytes at most) is sent again batch by batch."""
    with run_server(env={"STEPSCOPE_MAX_BODY_BYTES": "3000"}) as server:
        relay = NodeRelay(server.url, window_s=30.0, max_bundle_batches=3)
        relay.start()
        nan = json.dumps(make_batch(rank=9)).replace("0.52", "NaN")
        not_json = relay.relay(nan.encode(), content_encoding=None, authorization=None)
        answers = post_together(relay.url, [make_batch(rank=r) for r in range(3)])
        relay.stop()
        steps = read_rows(server.db_url, "steps", "job-a")
    assert not_json.status == 422
    assert b"NaN" in not_json.body
    assert [status for status, _ in answers] == [200, 200, 200]
    assert relay.stats.num_requests == 1 + 1 + 3  # the NaN batch, the bundle, each batch
    assert sorted({r["rank"] for r in steps}) == [0, 1, 2]


def test_a_collector_that_cannot_be_reached_is_a_502_each_rank_retries() -> None:
    relay = NodeRelay(f"http://127.0.0.1:{free_port()}", window_s=0.05)
    answer = relay.relay(
        json.dumps(make_batch()).encode(), content_encoding=None, authorization=None
    )
    assert answer.status == 502
    assert b"collector unreachable" in answer.body


def test_what_the_relay_cannot_bundle_is_passed_on_as_it_came(live_server: RunningServer) -> None:
    relay = NodeRelay(live_server.url, window_s=30.0)
    answer = relay.relay(b"\x1f\x8bnot gzip", content_encoding="gzip", authorization=None)
    assert answer.status == 400
    assert b"not valid gzip" in answer.body
    assert relay.stats.num_requests == 1


def test_shippers_of_a_node_flush_in_the_same_slot_and_nodes_spread_over_the_interval() -> None:
    interval_s = 30.0
    now_s = 1_767_000_000.123
    assert node_slot_wait_s(now_s, interval_s, "node-7") == node_slot_wait_s(
        now_s, interval_s, "node-7"
    )
    slots = [(now_s + node_slot_wait_s(now_s, interval_s, f"node-{n}")) for n in range(512)]
    assert all(now_s < slot <= now_s + interval_s for slot in slots)
    # The same slot one interval later; and the nodes' slots cover the interval evenly.
    later_s = slots[0] + 0.5
    assert later_s + node_slot_wait_s(later_s, interval_s, "node-0") == pytest.approx(
        slots[0] + interval_s
    )
    deciles = [int((slot - now_s) / interval_s * 10) for slot in slots]
    assert min(deciles.count(d) for d in range(10)) > 512 / 10 / 2


def test_a_rank_posts_its_batches_to_the_relay_over_one_connection(
    live_server: RunningServer,
) -> None:
    relay = NodeRelay(live_server.url, window_s=0.01)
    relay.start()
    poster = Poster(relay.url + "/v1/ingest", timeout_s=30.0)
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    answers, local_ports = [], set()
    for seq in range(3):
        batch = {**make_batch(rank=5), "seq": seq}
        answers.append(json.loads(poster.post(gzip.compress(json.dumps(batch).encode()), headers)))
        assert poster._connection is not None
        local_ports.add(poster._connection.sock.getsockname()[1])
    poster.close()
    relay.stop()
    assert [answer["duplicate"] for answer in answers] == [False, False, False]
    assert len(local_ports) == 1
    assert relay.stats.num_batches == 3


def test_shippers_deliver_through_the_relay_and_fall_back_when_it_is_gone(
    live_server: RunningServer,
) -> None:
    relay = NodeRelay(live_server.url, window_s=0.05)
    relay.start()
    through = build(live_server.url, relay_url=relay.url, flush_interval_s=0.1)
    gone = build(live_server.url, relay_url=f"http://127.0.0.1:{free_port()}")
    gone._source = {**gone._source, "rank": 1}
    for step in range(50):
        through.add("steps", step_row(step))
        gone.add("steps", step_row(step))
    assert through.close(timeout_s=10)
    assert gone.close(timeout_s=10)
    relay.stop()
    assert relay.stats.num_batches == through.stats.num_batches_sent >= 1
    steps = read_rows(live_server.db_url, "steps", "ship-1")
    assert sorted((r["rank"], r["step"]) for r in steps) == [
        (rank, step) for rank in (0, 1) for step in range(50)
    ]


def test_stepscope_run_gives_the_ranks_a_relay(
    live_server: RunningServer, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two ranks post through the relay `stepscope run` started; --no-node-relay: none."""
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, sys, threading
            sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
            from tests.collector.test_ingest import make_batch
            from tests.live_server import post_batch
            relay = os.environ.get("STEPSCOPE_RELAY_URL")
            if relay is None:
                sys.exit(5)
            ranks = [threading.Thread(target=post_batch, args=(relay, make_batch(rank=r)))
                     for r in (0, 1)]
            for rank in ranks:
                rank.start()
            for rank in ranks:
                rank.join()
            """
        )
    )
    cmd = [sys.executable, str(script)]
    assert launch(cmd, job_id="run-1", url=live_server.url, token=None) == 0
    steps = read_rows(live_server.db_url, "steps", "job-a")
    assert sorted((r["rank"], r["step"]) for r in steps) == [
        (rank, step) for rank in (0, 1) for step in (10, 11, 12)
    ]
    assert "the node relay sent 2 batches of this node's ranks in" in capfd.readouterr().err
    assert launch(cmd, job_id="run-2", url=live_server.url, token=None, node_relay=False) == 5
