"""A hand-built job on a 2 × 2 DeviceMesh (dp_shard × tp) whose rank 3 computes late.

Rank r sits at dp_shard coordinate r // 2 and tp coordinate r % 2. Each step every rank
all-gathers in its dp_shard group (FSDP: ranks {0, 2} and {1, 3}) and all-reduces in its tp
group ({0, 1} and {2, 3}); the collectives are synchronous, so a rank's wait is its busy time
and every rank's step ends together, when the last rank's collectives do:

    ready[r] = data + compute[r]        end = max over ranks of ready + transfers
    busy[r]  = transfer + wait[r]       wait[r] = end - transfers - ready[r]

From step LATE_FROM rank 3 computes LATE_S longer. Its dp_shard peer (rank 1) spends all of
its extra wait in the all-gather, its tp peer (rank 2) only TP_SHARE of it in the all-reduce:
the peers wait for rank 3 longest in dp_shard.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import polars as pl

JOB_ID = "mesh-2x2"
NUM_STEPS = 300
LATE_RANK = 3
LATE_FROM = 150
LATE_S = 0.05
TP_SHARE = 0.6
"""Share of rank 2's extra wait spent in its tp all-reduce (the rest in its all-gather)."""
AG_S, AR_S, DATA_S, COMPUTE_S = 0.02, 0.01, 0.01, 0.5
GROUPS = {
    # (mesh_dim, coordinate of the other dimension) -> (group name, members)
    ("dp_shard", 0): ("3", "0-2:2"),
    ("dp_shard", 1): ("4", "1-3:2"),
    ("tp", 0): ("1", "0-1"),
    ("tp", 1): ("2", "2-3"),
}
AG_WAIT_SHARE = {0: 0.5, 1: 1.0, 2: 1.0 - TP_SHARE, 3: 1.0}
"""Share of each rank's extra wait spent in its all-gather."""


def mesh_of(rank: int, dims: tuple[str, str] = ("dp_shard", "tp")) -> dict[str, list[int]]:
    return {dims[0]: [rank // 2, 2], dims[1]: [rank % 2, 2]}


def mesh_job(seed: int = 5) -> dict[str, pl.DataFrame]:
    """steps, collectives (per group) and ranks frames of the job."""
    rng = np.random.default_rng(seed)
    steps = np.arange(NUM_STEPS)
    compute = COMPUTE_S * (1.0 + 0.01 * rng.standard_normal((NUM_STEPS, 4)))
    compute[LATE_FROM:, LATE_RANK] += LATE_S
    ready = DATA_S + compute
    end = ready.max(axis=1, keepdims=True) + AG_S + AR_S
    wait = end - AG_S - AR_S - ready
    step_rows: dict[str, list[Any]] = {c: [] for c in ("rank", "step", "ts", "step_s", "data_s")}
    step_rows["comm_wait_s"] = []
    rows: dict[str, list[Any]] = {
        c: []
        for c in (
            *("rank", "step", "group", "op", "group_size", "count", "bytes", "busy_s"),
            *("wait_s", "first_seq", "mesh_dim", "group_ranks"),
        )
    }
    starts = 1.7e9 + np.concatenate(([0.0], np.cumsum(end[:, 0])[:-1]))
    for r in range(4):
        step_rows["rank"] += [r] * NUM_STEPS
        step_rows["step"] += steps.tolist()
        step_rows["ts"] += starts.tolist()
        step_rows["step_s"] += end[:, 0].tolist()
        step_rows["data_s"] += [DATA_S] * NUM_STEPS
        step_rows["comm_wait_s"] += (end[:, 0] - ready[:, r]).tolist()
        ag = AG_S + AG_WAIT_SHARE[r] * wait[:, r]
        ar = AR_S + (1.0 - AG_WAIT_SHARE[r]) * wait[:, r]
        calls = (
            ("all_gather", "dp_shard", r % 2, ag, 6, 6 * 2**24),
            ("all_reduce", "tp", r // 2, ar, 3, 3 * 2**22),
        )
        for op, dim, other, busy, count, num_bytes in calls:
            name, members = GROUPS[(dim, other)]
            for i in range(NUM_STEPS):
                rows["rank"].append(r)
                rows["step"].append(i)
                rows["group"].append(name)
                rows["op"].append(op)
                rows["group_size"].append(2)
                rows["count"].append(count)
                rows["bytes"].append(num_bytes)
                rows["busy_s"].append(float(busy[i]))
                rows["wait_s"].append(float(busy[i]))
                rows["first_seq"].append(count * i)
                rows["mesh_dim"].append(dim)
                rows["group_ranks"].append(members)
    collectives = pl.DataFrame(rows).sort("rank", "step", "group", "op")
    ranks = pl.DataFrame(
        {
            "rank": list(range(4)),
            "node": ["node-0000"] * 2 + ["node-0001"] * 2,
            "mesh": [json.dumps(mesh_of(r)) for r in range(4)],
        }
    )
    return {
        "steps": pl.DataFrame(step_rows).with_columns(pl.lit(JOB_ID).alias("job_id")),
        "collectives": collectives,
        "ranks": ranks,
    }


def old_format(collectives: pl.DataFrame) -> pl.DataFrame:
    """The rows as an older profiler sends them: no group, wait_s, first_seq, mesh_dim or
    group_ranks (one row per rank, step and op)."""
    return collectives.drop("group", "wait_s", "first_seq", "mesh_dim", "group_ranks")


def write_in_rounds(engine: Any, frames: dict[str, pl.DataFrame], *, steps: int = 50) -> Any:
    """Store the job through the wire validator and writer, every rank's next `steps` steps
    at a time (each rank sends its mesh); yields after each round is committed."""
    import orjson

    from stepscope import schema
    from stepscope.collector.validate import parse_batch
    from stepscope.store.writer import BatchWriter

    def section(frame: pl.DataFrame, table: schema.Table) -> dict[str, list[Any]]:
        return {c.name: frame[c.name].to_list() for c in table.wire_columns if c.name in frame}

    writer = BatchWriter(engine)
    try:
        for seq, first in enumerate(range(0, NUM_STEPS, steps)):
            in_round = pl.col("step").is_between(first, first + steps - 1)
            for r in range(4):
                mine = in_round & (pl.col("rank") == r)
                doc = {
                    "schema": schema.WIRE_SCHEMA_VERSION,
                    "job": {"job_id": JOB_ID, "world_size": 4},
                    "source": {
                        "rank": r,
                        "node": f"node-{r // 2:04d}",
                        "incarnation": f"i{r}",
                        "mesh": mesh_of(r),
                    },
                    "seq": seq,
                    "steps": section(frames["steps"].filter(mine), schema.STEPS),
                    "collectives": section(frames["collectives"].filter(mine), schema.COLLECTIVES),
                }
                batch = parse_batch(orjson.loads(orjson.dumps(doc)))
                writer.write(
                    job=batch.job, source=batch.source, seq=batch.seq, sections=batch.sections
                )
            yield seq
    finally:
        writer.close()
