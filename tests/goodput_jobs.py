"""Goodput timelines (stepscope.synthetic.goodput_timelines) as the wire would carry them,
and stored through the real validator and writer."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from stepscope.collector.validate import parse_batch
from stepscope.store.writer import BatchWriter
from stepscope.synthetic.goodput_timelines import Timeline


def batches(timeline: Timeline, job_id: str) -> list[dict[str, Any]]:
    """One wire batch per rank: its step rows and its events."""
    assert timeline.rank_rows is not None
    out = []
    for rank in range(timeline.world_size):
        rows = timeline.rank_rows.filter(timeline.rank_rows["rank"] == rank)
        events = timeline.events.filter(timeline.events["rank"] == rank)
        out.append(
            {
                "schema": 1,
                "job": {"job_id": job_id, "world_size": timeline.world_size},
                "source": {"rank": rank, "incarnation": "one-sender"},
                "seq": 0,
                "steps": {
                    c: rows[c].to_list() for c in ("step", "ts", "step_s", "data_s", "comm_wait_s")
                },
                "events": [
                    {
                        "ts": ts,
                        "kind": kind,
                        "message": message,
                        "attributes": json.loads(attributes),
                    }
                    for ts, kind, message, attributes in events.select(
                        "ts", "kind", "message", "attributes"
                    ).iter_rows()
                ],
            }
        )
    return out


def store_timeline(
    engine: sa.Engine, timeline: Timeline, job_id: str, job: dict[str, Any] | None = None
) -> None:
    """Store the timeline's batches as job `job_id` (its jobs row completed by `job`)."""
    writer = BatchWriter(engine)
    try:
        for doc in batches(timeline, job_id):
            doc["job"].update(job or {})
            batch = parse_batch(doc)
            writer.write(job=batch.job, source=batch.source, seq=batch.seq, sections=batch.sections)
    finally:
        writer.close()
