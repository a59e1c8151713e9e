"""Simulated hangs of a 3-D parallel job (dp x tp x pp): the reports every rank would send to
POST /v1/hangs, and what the attribution should name (tests and benchmarks/hang_attribution.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from stepscope import schema

DATA_STACK = [
    {"file": "train.py", "line": 88, "function": "train_step"},
    {"file": "data.py", "line": 41, "function": "load_batch"},
]
WAIT_STACK = [
    {"file": "train.py", "line": 90, "function": "train_step"},
    {"file": "torch/distributed/distributed_c10d.py", "line": 2501, "function": "all_reduce"},
]
OTHER_OP_STACK = [
    {"file": "train.py", "line": 97, "function": "train_step"},
    {"file": "torch/distributed/distributed_c10d.py", "line": 3300, "function": "all_gather"},
]


@dataclass(frozen=True, slots=True)
class Layout:
    """Ranks r = (stage * dp + d) * tp + t; process groups named as c10d would ("1", "2", ...)."""

    dp: int
    tp: int
    pp: int
    ranks_per_node: int = 8

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, d, t)."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def tp_group(self, rank: int) -> str:
        stage, d, _ = self.coords(rank)
        return str(1 + stage * self.dp + d)

    def dp_group(self, rank: int) -> str:
        stage, _, t = self.coords(rank)
        return str(1 + self.pp * self.dp + stage * self.tp + t)

    def pp_group(self, rank: int) -> str:
        return str(1 + self.pp * self.dp + self.pp * self.tp + rank % (self.dp * self.tp))

    def tp_members(self, rank: int) -> list[int]:
        first = rank - rank % self.tp
        return list(range(first, first + self.tp))

    def frontiers(self, rank: int, seqs: dict[str, tuple[int, int]]) -> list[dict[str, Any]]:
        """Per group of the rank: name, mesh_dim, compact members, size and its frontier."""
        stage, d, t = self.coords(rank)
        tp0 = rank - t
        dp0 = stage * self.dp * self.tp + t
        pp0 = rank % (self.dp * self.tp)
        out = []
        for dim, name, members in (
            ("tp", self.tp_group(rank), range(tp0, tp0 + self.tp)),
            ("dp", self.dp_group(rank), range(dp0, dp0 + self.dp * self.tp, self.tp)),
            ("pp", self.pp_group(rank), range(pp0, self.world_size, self.dp * self.tp)),
        ):
            enqueued, completed = seqs[dim]
            out.append(
                {
                    "group": name,
                    "mesh_dim": dim,
                    "group_ranks": schema.compact_ranks(list(members)),
                    "size": len(members),
                    "enqueued": enqueued,
                    "completed": completed,
                }
            )
        world = seqs.get("world", (0, 0))
        out.append(
            {
                "group": "0",
                "mesh_dim": None,
                "group_ranks": f"0-{self.world_size - 1}",
                "size": self.world_size,
                "enqueued": world[0],
                "completed": world[1],
            }
        )
        return out

    def node(self, rank: int) -> str:
        return f"node-{rank // self.ranks_per_node:04d}"


@dataclass(frozen=True, slots=True)
class Injected:
    """A simulated hang: every rank's report and what attribution should say."""

    hang_class: schema.HangClass
    culprits: list[int]
    """The ranks to name (for not_completing: every member of the stuck groups)."""
    group: str
    op: str
    seq: int
    reports: list[dict[str, Any]]
    """The hang reports, in the order they would arrive (the culprits' interleaved)."""
    heartbeats: list[dict[str, Any]]
    """The heartbeats every live rank sent before its watchdog declared the hang (5 s in,
    the same state without stacks): send them first."""


def report(
    layout: Layout,
    job_id: str,
    rank: int,
    *,
    ts: float,
    kind: str,
    step: int,
    seqs: dict[str, tuple[int, int]],
    blocked: dict[str, Any] | None = None,
    stack: list[dict[str, Any]] | None = None,
    stalled_s: float = 0.2,
    phase: str | None = None,
) -> dict[str, Any]:
    """One rank's report in the wire format of POST /v1/hangs."""
    return {
        "schema": 1,
        "job_id": job_id,
        "rank": rank,
        "incarnation": "inc-1",
        "node": layout.node(rank),
        "pid": 1000 + rank,
        "world_size": layout.world_size,
        "ts": ts,
        "kind": kind,
        "step": step,
        "section": "forward" if blocked is None else "backward",
        "phase": phase,
        "last_progress_ts": ts - stalled_s,
        "stalled_s": stalled_s,
        "blocked": blocked,
        "frontiers": layout.frontiers(rank, seqs),
        "stack": stack,
        "stack_source": "watchdog" if stack is not None else None,
    }


def heartbeats(
    layout: Layout, job_id: str, *, ts: float, step: int, base_seq: int
) -> list[dict[str, Any]]:
    """Every rank's heartbeat of a job making progress at `step`."""
    seqs = dict.fromkeys(("tp", "dp", "pp"), (base_seq, base_seq))
    return [
        report(layout, job_id, r, ts=ts + r * 1e-6, kind="heartbeat", step=step, seqs=seqs)
        for r in range(layout.world_size)
    ]


def inject(
    layout: Layout,
    job_id: str,
    hang_class: schema.HangClass,
    num_culprits: int,
    *,
    ts: float,
    step: int,
    base_seq: int,
    rng: random.Random,
    hang_after_s: float = 10.0,
) -> Injected:
    """A hang of `hang_class` by `num_culprits` ranks (groups, for not_completing) of one
    pipeline stage that began at `ts`, reported `hang_after_s` later (frontiers were at
    `base_seq` before it).

    The culprit's tensor-parallel peers block in their all_reduce, the rest of its stage in
    the data-parallel all_reduce, the other stages in the pipeline's recv.
    """
    s = base_seq + 1
    stage = rng.randrange(layout.pp)
    stage_ranks = range(stage * layout.dp * layout.tp, (stage + 1) * layout.dp * layout.tp)
    groups = rng.sample(range(layout.dp), num_culprits)
    if hang_class == "not_completing":
        picked = [stage_ranks[0] + d * layout.tp for d in groups]
        culprits = sorted(m for r in picked for m in layout.tp_members(r))
    elif hang_class == "mismatched":  # one per group: a minority in each
        culprits = sorted(stage_ranks[0] + d * layout.tp + rng.randrange(layout.tp) for d in groups)
    else:
        culprits = sorted(rng.sample(list(stage_ranks), num_culprits))
    culprit_set = set(culprits)
    stuck_tp = {layout.tp_group(r) for r in culprits}
    hang_ts = ts + hang_after_s
    reports = []
    for r in range(layout.world_size):
        rts = hang_ts + rng.uniform(0.0, 0.5)
        if r in culprit_set and hang_class == "silent":
            continue  # its last heartbeat (at ts - 1) stays its latest report
        if layout.coords(r)[0] != stage:
            seqs = {"tp": (s, s), "dp": (s, s), "pp": (s, base_seq)}
            blocked = {"group": layout.pp_group(r), "op": "recv", "seq": s, "since_ts": ts + 0.5}
            stack = WAIT_STACK
        elif r in culprit_set and hang_class == "never_entered":
            seqs = {"tp": (base_seq, base_seq), "dp": (base_seq, base_seq), "pp": (base_seq,) * 2}
            blocked, stack = None, DATA_STACK
        elif layout.tp_group(r) in stuck_tp:
            seqs = {"tp": (s, base_seq), "dp": (base_seq, base_seq), "pp": (base_seq, base_seq)}
            op = "all_gather" if r in culprit_set and hang_class == "mismatched" else "all_reduce"
            blocked = {"group": layout.tp_group(r), "op": op, "seq": s, "since_ts": ts + 0.1}
            stack = OTHER_OP_STACK if op == "all_gather" else WAIT_STACK
        else:
            seqs = {"tp": (s, s), "dp": (s, base_seq), "pp": (base_seq, base_seq)}
            blocked = {
                "group": layout.dp_group(r),
                "op": "all_reduce",
                "seq": s,
                "since_ts": ts + 0.3,
            }
            stack = WAIT_STACK
        reports.append(
            report(
                layout,
                job_id,
                r,
                ts=rts,
                kind="hang",
                step=step,
                seqs=seqs,
                blocked=blocked,
                stack=stack,
                stalled_s=rts - ts,
            )
        )
    rng.shuffle(reports)
    before = [
        {**doc, "kind": "heartbeat", "ts": doc["ts"] - 5.0, "stalled_s": doc["stalled_s"] - 5.0}
        | {"last_progress_ts": doc["last_progress_ts"], "stack": None, "stack_source": None}
        for doc in reports
    ]
    primary = culprits[0]
    op = "all_reduce,all_gather" if hang_class == "mismatched" else "all_reduce"
    return Injected(
        hang_class=hang_class,
        culprits=culprits,
        group=layout.tp_group(primary),
        op=op,
        seq=s,
        reports=reports,
        heartbeats=before,
    )


def checkpointing(
    layout: Layout, job_id: str, *, ts: float, step: int, base_seq: int
) -> list[dict[str, Any]]:
    """Rank 0 saves a checkpoint (a declared phase, 30 s so far) while every other rank waits
    in a barrier of the world group and reports a hang (they declared no phase)."""
    s = base_seq + 1
    out = []
    for r in range(layout.world_size):
        seqs = dict.fromkeys(("tp", "dp", "pp"), (base_seq, base_seq))
        if r == 0:
            out.append(
                report(
                    layout,
                    job_id,
                    0,
                    ts=ts + 30,
                    kind="heartbeat",
                    step=step,
                    seqs={**seqs, "world": (base_seq, base_seq)},
                    stalled_s=30.0,
                    phase="checkpoint_save",
                )
            )
            continue
        out.append(
            report(
                layout,
                job_id,
                r,
                ts=ts + 30,
                kind="hang",
                step=step,
                seqs={**seqs, "world": (s, base_seq)},
                blocked={"group": "0", "op": "barrier", "seq": s, "since_ts": ts + 0.1},
                stack=WAIT_STACK,
                stalled_s=30.0,
            )
        )
    return out
