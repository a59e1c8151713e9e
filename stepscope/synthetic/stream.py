"""Stream a synthetic job (synthetic.generate) to a collector through the real wire protocol,
or store it through the collector's validator and writer without HTTP (store_rounds)."""

from __future__ import annotations

import asyncio
import gzip
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson
import sqlalchemy as sa

from stepscope import schema
from stepscope.collector.validate import parse_batch
from stepscope.store.writer import BatchWriter
from stepscope.synthetic.generate import Columns, SynthJob

_SECTIONS = {"steps": schema.STEPS, "collectives": schema.COLLECTIVES, "gpu": schema.GPU}


def _rank_slice(columns: Columns, rank: int) -> slice:
    """Row range of one rank in columns sorted by rank (a binary search: the batches of every
    rank of a 16,384-rank job take linear time, not quadratic)."""
    if not columns:
        return slice(0, 0)
    lo, hi = np.searchsorted(columns["rank"], [rank, rank + 1])
    return slice(int(lo), int(hi))


def _wire_section(columns: Columns, rows: slice, table: schema.Table) -> dict[str, Any]:
    return {c.name: columns[c.name][rows].tolist() for c in table.wire_columns if c.name in columns}


def rank_batches(job: SynthJob, rank: int, *, steps_per_batch: int) -> Iterator[dict[str, Any]]:
    """Wire batches of one rank, `steps_per_batch` steps each, GPU samples by time."""
    spec = job.spec
    incarnation = uuid.uuid4().hex
    job_meta = {k: v for k, v in job.job.items() if k not in ("status", "ended_at", "started_at")}
    per_rank = {
        name: (cols, _rank_slice(cols, rank))
        for name, cols in (("steps", job.steps), ("collectives", job.collectives), ("gpu", job.gpu))
    }
    step_rows = per_rank["steps"][1]
    step_ts = job.steps["ts"][step_rows]
    for seq, first in enumerate(range(0, spec.num_steps, steps_per_batch)):
        last = min(first + steps_per_batch, spec.num_steps)
        doc: dict[str, Any] = {
            "schema": schema.WIRE_SCHEMA_VERSION,
            "job": job_meta,
            "source": {
                "rank": rank,
                "local_rank": rank % spec.ranks_per_node,
                "node": job.nodes[rank],
                "pid": 10_000 + rank,
                "incarnation": incarnation,
            },
            "seq": seq,
        }
        if job.gpus is not None:
            doc["source"]["attributes"] = {"gpu.uuid": job.gpus[rank]}
        for name, (cols, rows) in per_rank.items():
            if not cols:
                continue
            if name == "gpu":
                lo_ts = step_ts[first]
                hi_ts = step_ts[last] if last < spec.num_steps else np.inf
                ts = cols["ts"][rows]
                lo, hi = np.searchsorted(ts, [lo_ts, hi_ts])
                part = slice(rows.start + int(lo), rows.start + int(hi))
            else:
                part_steps = cols["step"][rows]
                lo, hi = np.searchsorted(part_steps, [first, last])
                part = slice(rows.start + int(lo), rows.start + int(hi))
            if part.stop > part.start:
                doc[name] = _wire_section(cols, part, _SECTIONS[name])
        if last == spec.num_steps:
            doc["job"] = {**job_meta, "status": "finished", "ended_at": job.job["ended_at"]}
        yield doc


def encode(doc: dict[str, Any]) -> bytes:
    return gzip.compress(orjson.dumps(doc), compresslevel=1)


@dataclass(slots=True)
class StreamStats:
    batches: int = 0
    rows: int = 0
    duplicates: int = 0
    failures: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


async def post_bodies(
    url: str,
    rounds: list[list[bytes]],
    *,
    token: str | None = None,
    concurrency: int = 64,
    round_interval_s: float = 0.0,
) -> StreamStats:
    """POST gzip bodies round by round (one round = one batch per rank), optionally paced."""
    stats = StreamStats()
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=120
    ) as client:

        async def send(body: bytes) -> None:
            async with gate:
                for attempt in range(5):
                    try:
                        resp = await client.post("/v1/ingest", content=body)
                    except httpx.TransportError as exc:
                        error = f"{type(exc).__name__}: {exc}"
                    else:
                        if resp.status_code == 200:
                            result = resp.json()
                            stats.batches += 1
                            stats.rows += sum(result["accepted"].values())
                            stats.duplicates += bool(result["duplicate"])
                            return
                        error = f"{resp.status_code}: {resp.text[:200]}"
                        if resp.status_code < 500:
                            break
                    await asyncio.sleep(0.2 * 2**attempt)
                stats.failures.append(error)

        for i, bodies in enumerate(rounds):
            if round_interval_s > 0:
                delay = start + i * round_interval_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            await asyncio.gather(*(send(b) for b in bodies))
    stats.elapsed_s = time.perf_counter() - start
    return stats


def batch_rounds(job: SynthJob, *, steps_per_batch: int) -> list[list[bytes]]:
    """Encoded batches grouped by round: round k holds batch k of every rank."""
    per_rank = [
        [encode(doc) for doc in rank_batches(job, rank, steps_per_batch=steps_per_batch)]
        for rank in range(job.spec.num_ranks)
    ]
    return [list(bodies) for bodies in zip(*per_rank, strict=True)]


def stream_job(
    job: SynthJob,
    url: str,
    *,
    token: str | None = None,
    steps_per_batch: int = 10,
    concurrency: int = 64,
    steps_per_s: float | None = None,
) -> StreamStats:
    """Send every rank's records; with `steps_per_s`, pace rounds to that training speed."""
    rounds = batch_rounds(job, steps_per_batch=steps_per_batch)
    interval_s = steps_per_batch / steps_per_s if steps_per_s else 0.0
    return asyncio.run(
        post_bodies(url, rounds, token=token, concurrency=concurrency, round_interval_s=interval_s)
    )


def store_rounds(engine: sa.Engine, job: SynthJob, *, steps_per_batch: int = 25) -> Iterator[int]:
    """Store a job through the real validator and writer, one round of batches (every rank's
    next `steps_per_batch` steps) at a time; yields the round number after each is committed."""
    per_rank = [
        list(rank_batches(job, r, steps_per_batch=steps_per_batch))
        for r in range(job.spec.num_ranks)
    ]
    writer = BatchWriter(engine)
    try:
        for i in range(len(per_rank[0])):
            for batches in per_rank:
                doc = orjson.loads(orjson.dumps(batches[i], option=orjson.OPT_SERIALIZE_NUMPY))
                batch = parse_batch(doc)
                writer.write(
                    job=batch.job, source=batch.source, seq=batch.seq, sections=batch.sections
                )
            yield i
    finally:
        writer.close()
