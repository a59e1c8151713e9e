"""The synthetic jobs the api, dashboard and query tests share, and their rows as frames."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson
import polars as pl
import sqlalchemy as sa

from stepscope.analysis.rollups import with_compute
from stepscope.collector.validate import parse_batch
from stepscope.schema import compact_ranks
from stepscope.store.writer import BatchWriter
from stepscope.synthetic.generate import JobSpec, Straggler, SynthJob, generate, to_frames
from stepscope.synthetic.stream import rank_batches

NUM_RANKS = 8
RANKS_PER_NODE = 4
NUM_STEPS = 400
STRAGGLER = 5
"""The rank slowed 1.3× in compute from STRAGGLER_FROM on."""
STRAGGLER_FROM = 200


def straggler_job(
    job_id: str,
    *,
    num_ranks: int = NUM_RANKS,
    num_steps: int = NUM_STEPS,
    straggler_from: int = STRAGGLER_FROM,
    start_ts: float | None = None,
    seed: int = 3,
) -> SynthJob:
    """A job of RANKS_PER_NODE ranks a node, without spikes, whose rank STRAGGLER is slowed."""
    return generate(
        JobSpec(
            job_id=job_id,
            num_ranks=num_ranks,
            ranks_per_node=RANKS_PER_NODE,
            num_steps=num_steps,
            spike_prob=0.0,
            stragglers=(
                Straggler(
                    ranks=(STRAGGLER,), factor=1.3, cause="compute", from_step=straggler_from
                ),
            ),
            start_ts=time.time() - num_steps * 0.5 if start_ts is None else start_ts,
            seed=seed,
        )
    )


def step_rows(job: SynthJob) -> pl.DataFrame:
    """The job's step rows as generated, as float64, with compute_s derived as the rollups do."""
    steps = to_frames(job)["steps"]
    floats = [column for column, dtype in steps.schema.items() if dtype.is_float()]
    return with_compute(steps.with_columns(pl.col(floats).cast(pl.Float64)))


# A job on a 2 × 2 × 2 DeviceMesh (pp, dp, tp) with per-group collectives.

MESH_DIMS = ("pp", "dp", "tp")
MESH_BYTES = {"tp": 4 << 20, "dp": 64 << 20}
"""Bytes per rank and step of the tp all-gathers and of the dp all-reduces."""
MESH_CALLS = {"tp": 8, "dp": 2}


def mesh_of(rank: int) -> dict[str, list[int]]:
    """Rank r of the 8-rank mesh: stage r // 4, dp (r // 2) % 2, tp r % 2 (source.mesh)."""
    return {"pp": [rank // 4, 2], "dp": [(rank // 2) % 2, 2], "tp": [rank % 2, 2]}


def _mesh_peers(rank: int, dim: str) -> list[int]:
    """The ranks of `rank`'s process group along `dim` (the same coordinates elsewhere)."""
    me = mesh_of(rank)
    return [
        r
        for r in range(NUM_RANKS)
        if all(mesh_of(r)[d][0] == me[d][0] for d in MESH_DIMS if d != dim)
    ]


def mesh_job(job_id: str, **kwargs: Any) -> SynthJob:
    """straggler_job on the 8-rank mesh: per rank and step one row of tp all-gathers and
    one of dp all-reduces (busy time split 1:3 from the generated all-reduce), each in the
    process group of the rank's mesh peers, named by its first member and dim."""
    job = straggler_job(job_id, **kwargs)
    c = job.collectives
    n = c["rank"].size
    rows = np.repeat(np.arange(n), 2)  # rank-major, then step: two rows per (rank, step)
    dim = np.tile(np.array(["tp", "dp"], dtype=object), n)
    ranks = c["rank"][rows]
    peers = {(r, d): _mesh_peers(r, d) for r in range(NUM_RANKS) for d in ("tp", "dp")}
    member_lists = [peers[(int(r), str(d))] for r, d in zip(ranks, dim, strict=True)]
    is_tp = dim == "tp"
    job.collectives = {
        "rank": ranks,
        "step": c["step"][rows],
        "group": np.array([f"{d}{m[0]}" for d, m in zip(dim, member_lists, strict=True)],
                          dtype=object),
        "op": np.where(is_tp, "all_gather", "all_reduce").astype(object),
        "group_size": np.full(2 * n, 2, dtype=np.int64),
        "count": np.where(is_tp, MESH_CALLS["tp"], MESH_CALLS["dp"]).astype(np.int64),
        "bytes": np.where(is_tp, MESH_BYTES["tp"], MESH_BYTES["dp"]).astype(np.int64),
        "busy_s": c["busy_s"][rows] * np.where(is_tp, 0.25, 0.75),
        "wait_s": c["busy_s"][rows] * np.where(is_tp, 0.25, 0.75),
        "first_seq": c["step"][rows] * np.where(is_tp, MESH_CALLS["tp"], MESH_CALLS["dp"]),
        "mesh_dim": dim,
        "group_ranks": np.array([compact_ranks(m) for m in member_lists], dtype=object),
    }  # fmt: skip
    return job


def store_mesh_job(engine: sa.Engine, job: SynthJob, *, steps_per_batch: int = 100) -> None:
    """Send every rank's wire batches, with its source.mesh, through validation and the
    real writer."""
    writer = BatchWriter(engine)
    try:
        for rank in range(job.spec.num_ranks):
            for doc in rank_batches(job, rank, steps_per_batch=steps_per_batch):
                doc["source"]["mesh"] = mesh_of(rank)
                batch = parse_batch(orjson.loads(orjson.dumps(doc)))
                writer.write(
                    job=batch.job, source=batch.source, seq=batch.seq, sections=batch.sections
                )
    finally:
        writer.close()
