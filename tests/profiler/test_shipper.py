from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from stepscope.profiler.config import Config
from stepscope.profiler.shipping.shipper import Shipper, dumps_in_chunks, retry_after_s
from stepscope.schema import STEPS
from tests.live_server import RunningServer, free_port, read_rows
from tests.profiler.http_sink import http_sink

JOB = {"job_id": "ship-1", "world_size": 1, "device_name": "cpu", "attributes": {}}
SOURCE = {"rank": 0, "local_rank": 0, "node": "host-a", "pid": 1, "incarnation": "inc-1"}


def step_row(step: int) -> dict[str, Any]:
    return {"step": step, "ts": 1.7e9 + step, "step_s": 0.01, "data_s": 0.001}


def build(url: str, **options: Any) -> Shipper:
    settings: dict[str, Any] = {"flush_interval_s": 0.05, "backoff_max_s": 0.2, **options}
    config = Config(url=url, **settings)
    return Shipper(config=config, job=dict(JOB), source=dict(SOURCE))


def test_batches_are_columnar_with_every_wire_column() -> None:
    with http_sink() as sink:
        shipper = build(sink.url)
        for step in range(3):
            shipper.add("steps", step_row(step))
        assert shipper.close(timeout_s=5)
    [body] = sink.accepted()
    assert body["schema"] == 1
    assert body["source"] == SOURCE
    assert list(body["steps"]) == [c.name for c in STEPS.wire_columns]
    assert body["steps"]["step"] == [0, 1, 2]
    assert body["steps"]["forward_s"] == [None, None, None]
    assert shipper.stats.num_rows_sent["steps"] == 3
    assert shipper.stats.num_bytes_sent == sink.body_bytes[0]


def test_a_batch_encoded_in_chunks_is_the_json_of_the_whole() -> None:
    rows = [step_row(step) for step in range(1_234)]
    payload = {
        "schema": 1,
        "job": dict(JOB),
        "seq": 3,
        "steps": {c: [r.get(c) for r in rows] for c in ("step", "ts", "step_s", "data_s")},
        "events": [{"ts": 1.7e9, "kind": "custom", "message": 'é " ,]', "attributes": {}}] * 700,
    }
    text = dumps_in_chunks(payload)
    assert json.loads(text) == payload
    assert text == json.dumps(payload, separators=(",", ":"))


def test_a_slow_collector_gets_a_batch_per_flush_interval_not_one_per_answer() -> None:
    # Rows that arrive while an answer takes 0.25 s wait for the next flush (every ~1 s);
    # posted as soon as the answer came, they made a batch per answer (9 in 3 s).
    with http_sink() as sink:
        sink.answer_delay_s = 0.25
        shipper = build(sink.url, flush_interval_s=1.0)
        started = time.monotonic()
        num_rows = 0
        while time.monotonic() - started < 3.0:
            shipper.add("steps", step_row(num_rows))
            num_rows += 1
            time.sleep(0.01)
        elapsed_s = time.monotonic() - started
        assert shipper.close(timeout_s=5)
    # A flush every 0.9-1.1 s, the first at once, and the last at close.
    assert len(sink.received) <= elapsed_s / 0.9 + 2
    steps = [step for body in sink.accepted() for step in body["steps"]["step"]]
    assert steps == list(range(num_rows))


def test_server_errors_are_retried_with_the_same_seq_and_incarnation() -> None:
    with http_sink() as sink:
        sink.statuses = [503, 500, 503]
        shipper = build(sink.url)
        shipper.add("steps", step_row(7))
        assert shipper.close(timeout_s=5)
    assert [b["_status"] for b in sink.received] == [503, 500, 503, 200]
    assert {(b["source"]["incarnation"], b["seq"]) for b in sink.received} == {("inc-1", 0)}
    assert shipper.stats.num_retries == 3
    assert shipper.stats.num_rows_sent["steps"] == 1


def test_the_final_status_is_retried_until_the_close_deadline_when_the_collector_is_busy() -> None:
    with http_sink() as sink:
        shipper = build(sink.url)
        shipper.add("steps", step_row(1))
        time.sleep(0.3)  # the records' batch goes first, accepted
        sink.statuses = [503] * 4
        assert shipper.close(timeout_s=5, final_job={"status": "finished", "ended_at": 2e9})
    final = [b for b in sink.received if b["job"].get("status") == "finished"]
    assert [b["_status"] for b in final] == [503, 503, 503, 503, 200]
    assert final[-1]["job"]["ended_at"] == 2e9


def test_a_503_with_retry_after_is_retried_no_sooner_than_the_collector_asked() -> None:
    with http_sink() as sink:
        sink.statuses, sink.retry_after = [503, 503], "1"
        shipper = build(sink.url, backoff_max_s=5.0)
        shipper.add("steps", step_row(3))
        assert shipper.close(timeout_s=10)
    assert [b["_status"] for b in sink.received] == [503, 503, 200]
    first, second, third = sink.arrived_s
    # The shipper's own backoff would retry within 0.05 s; the collector asked for 1 s.
    assert second - first >= 1.0
    assert third - second >= 1.0
    assert shipper.stats.num_retry_after == 2
    assert shipper.stats.num_rows_sent["steps"] == 1


def test_retry_after_is_read_as_seconds_or_as_an_http_date() -> None:
    import email.utils

    assert retry_after_s("7") == 7.0
    assert retry_after_s(None) == 0.0
    assert retry_after_s("soon") == 0.0
    in_20_s = email.utils.formatdate(time.time() + 20, usegmt=True)
    assert 18.0 <= retry_after_s(in_20_s) <= 20.0
    assert retry_after_s(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0


def test_a_rejected_batch_is_not_resent_and_is_counted_then_reported() -> None:
    with http_sink() as sink:
        sink.statuses = [422]
        shipper = build(sink.url)
        shipper.add("steps", step_row(1))
        shipper.flush_soon()
        deadline = time.monotonic() + 5
        while len(sink.received) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        shipper.add("steps", step_row(2))
        assert shipper.close(timeout_s=5)
    statuses = [b["_status"] for b in sink.received]
    assert statuses[0] == 422
    assert statuses.count(422) == 1
    assert shipper.stats.num_rejected_batches == 1
    assert shipper.stats.num_dropped["steps"] == 1
    events = [e for b in sink.accepted() for e in b.get("events", [])]
    assert len(events) == 1
    assert events[0]["attributes"]["dropped_steps"] == 1
    assert "dropped 1 records" in events[0]["message"]


def wait_for_requests(sink: Any, count: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(sink.received) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(sink.received) >= count


def test_a_drop_report_lost_with_its_batch_is_reported_again() -> None:
    with http_sink() as sink:
        # step 1's batch is rejected; step 2's is taken, and the report of step 1 follows it,
        # in a batch of its own that is rejected too; step 3's batch is taken.
        sink.statuses = [422, 200, 422]
        shipper = build(sink.url, flush_interval_s=60)
        for step, num_requests in ((1, 1), (2, 3), (3, 4)):
            shipper.add("steps", step_row(step))
            shipper.flush_soon()
            wait_for_requests(sink, num_requests)
        assert shipper.close(timeout_s=5)
    assert shipper.stats.num_dropped == {"steps": 1, "collectives": 0, "gpu": 0, "events": 1}
    reports = [e["attributes"] for b in sink.accepted() for e in b.get("events", [])]
    assert reports == [
        {"dropped_steps": 1, "dropped_collectives": 0, "dropped_gpu": 0, "dropped_events": 1}
    ]


def test_full_buffer_drops_new_records_and_reports_them() -> None:
    with http_sink() as sink:
        shipper = build(sink.url, max_buffer_rows=5, flush_interval_s=60)
        for step in range(8):
            shipper.add("steps", step_row(step))
        assert shipper.close(timeout_s=5)
    assert shipper.stats.num_dropped["steps"] == 3
    steps = [s for b in sink.accepted() for s in b.get("steps", {}).get("step", [])]
    assert steps == [0, 1, 2, 3, 4]
    events = [e for b in sink.accepted() for e in b.get("events", [])]
    assert [e["attributes"]["dropped_steps"] for e in events] == [3]


def test_batches_spill_to_disk_while_the_collector_is_down_and_are_resent(tmp_path: Path) -> None:
    with http_sink() as sink:
        sink.statuses = [503] * 1000
        shipper = build(sink.url, max_pending_batches=1, max_batch_rows=2, spill_dir=str(tmp_path))
        for step in range(6):
            shipper.add("steps", step_row(step))
        shipper.flush_soon()
        deadline = time.monotonic() + 5
        while shipper.stats.num_spilled_batches < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shipper.stats.num_spilled_batches == 2
        [spill_file] = tmp_path.iterdir()
        assert [json.loads(line)["seq"] for line in spill_file.read_text().splitlines()] == [1, 2]
        sink.statuses.clear()
        assert shipper.close(timeout_s=5)
    steps = sorted(s for b in sink.accepted() for s in b["steps"]["step"])
    assert steps == [0, 1, 2, 3, 4, 5]
    assert sorted(b["seq"] for b in sink.accepted()) == [0, 1, 2]
    assert not any(tmp_path.iterdir())
    assert shipper.stats.num_dropped["steps"] == 0


def test_close_returns_within_its_timeout_when_nothing_listens() -> None:
    shipper = build(f"http://127.0.0.1:{free_port()}")
    shipper.add("steps", step_row(0))
    start = time.monotonic()
    assert not shipper.close(timeout_s=0.5)
    assert time.monotonic() - start < 2.0


def test_records_reach_the_real_collector(live_server: RunningServer) -> None:
    shipper = build(live_server.url)
    for step in range(4):
        shipper.add("steps", step_row(step))
    shipper.add(
        "collectives",
        {
            "step": 0,
            "op": "all_reduce",
            "group_size": 2,
            "count": 3,
            "bytes": 4096,
            "busy_s": 0.002,
        },
    )
    shipper.add("events", {"ts": 1.7e9, "kind": "custom", "message": "hello", "attributes": {}})
    assert shipper.close(timeout_s=10)
    steps = read_rows(live_server.db_url, "steps", "ship-1")
    assert sorted(r["step"] for r in steps) == [0, 1, 2, 3]
    assert {r["step_s"] for r in steps} == {0.01}
    [collective] = read_rows(live_server.db_url, "collectives", "ship-1")
    assert (collective["count"], collective["bytes"]) == (3, 4096)
    [event] = read_rows(live_server.db_url, "events", "ship-1")
    assert event["message"] == "hello"
