"""A job whose profilers dropped records says so on its page and in its summary."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from stepscope.schema import DROP_REPORT_PREFIX
from tests.live_server import post_batch, run_server


def _drop_report(rank: int, seq: int, num_steps: int, num_gpu: int) -> dict[str, Any]:
    """A batch as a profiler sends it after an outage that overflowed its buffers."""
    return {
        "schema": 1,
        "job": {"job_id": "dropping", "world_size": 2},
        "source": {"rank": rank, "incarnation": f"inc-{rank}"},
        "seq": seq,
        "steps": {"step": [seq], "ts": [1.7e9 + seq], "step_s": [0.1], "data_s": [0.0]},
        "events": [
            {
                "ts": 1.7e9 + seq,
                "kind": "custom",
                "message": f"{DROP_REPORT_PREFIX}{num_steps + num_gpu} records (buffer full or "
                "collector unreachable)",
                "attributes": {"dropped_steps": num_steps, "dropped_gpu": num_gpu},
            }
        ],
    }


def test_the_job_page_and_summary_say_how_many_records_were_dropped(browser: Any) -> None:
    with run_server() as server:
        post_batch(server.url, _drop_report(rank=0, seq=0, num_steps=1200, num_gpu=34))
        post_batch(server.url, _drop_report(rank=1, seq=0, num_steps=7, num_gpu=0))
        post_batch(server.url, _drop_report(rank=1, seq=1, num_steps=3, num_gpu=0))
        with urllib.request.urlopen(f"{server.url}/api/v1/jobs/dropping", timeout=30) as r:
            summary = json.loads(r.read())
        context = browser.new_context()
        try:
            page = context.new_page()
            page.goto(f"{server.url}/jobs/dropping")
            note = page.locator("[role=alert]", has_text="dropped")
            note.wait_for(timeout=60_000)
            text = note.inner_text()
        finally:
            context.close()
    assert summary["num_records_dropped"] == 1244
    assert "dropped 1,244 records" in text
