"""Pipeline stages on synthetic steps laid out as the profiler records them: a stage slow in
compute is the straggler; its neighbours, which wait for it in their receives and whose
sends to it last until it takes them, are not; what it costs is within its own excess."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import polars as pl
import pytest

from stepscope.analysis import AnalysisConfig, analyze
from stepscope.schema import Finding

NUM_STAGES = 4
NUM_STEPS = 240
MICROBATCHES = 4
COMPUTE_S = 0.010
"""Each stage's own work in a step, all its micro-batches."""
CLEAN_STEP_S = 0.035
"""The job's step: the stages' work and the pipeline's bubble."""
TRANSFER_S = 0.0004
"""One send or receive's own transfer."""
NODE = "host-0"


def pipeline_steps(
    slowed: Sequence[tuple[int, int, int]], delay_s: float, *, seed: int = 0
) -> dict[str, pl.DataFrame]:
    """steps, collectives and ranks frames of a GPipe job of NUM_STAGES stages, one a rank, on
    one node; each (stage, first, last) of `slowed` computes `delay_s` longer in those steps.

    Every rank's step lasts the job's step; the time a stage does not compute it waits in its
    receives (comm_wait_s). A send lasts until its receiver takes it: a slowed stage's
    upstream neighbour's sends each last as long as the stage is late (its forward sends,
    MICROBATCHES of them a step, all wait for it), as gloo's and NCCL's do."""
    rng = np.random.default_rng(seed)
    shape = (NUM_STEPS, NUM_STAGES)
    late_s = np.zeros(shape)
    for stage, first, last in slowed:
        late_s[first : last + 1, stage] = delay_s
    compute_s = COMPUTE_S * (1 + 0.05 * rng.standard_normal(shape)) + late_s
    step_s = (CLEAN_STEP_S + late_s.max(axis=1))[:, None] * (1 + 0.01 * rng.standard_normal(shape))
    data_s = np.full(shape, 0.0002)
    comm_wait_s = step_s - data_s - compute_s
    sends = np.full(shape, 2 * MICROBATCHES)
    sends[:, [0, NUM_STAGES - 1]] = MICROBATCHES  # the ends send one way only
    send_busy_s = sends * TRANSFER_S * (1 + 0.05 * rng.standard_normal(shape))
    send_busy_s[:, :-1] += MICROBATCHES * late_s[:, 1:]  # waiting for the next stage
    recv_busy_s = comm_wait_s + sends * TRANSFER_S
    rank = np.tile(np.arange(NUM_STAGES), NUM_STEPS)
    step = np.repeat(np.arange(NUM_STEPS), NUM_STAGES)
    steps = pl.DataFrame(
        {
            "job_id": "pipeline",
            "rank": rank,
            "step": step,
            "step_s": step_s.ravel(),
            "data_s": data_s.ravel(),
            "comm_wait_s": comm_wait_s.ravel(),
            "compute_s": compute_s.ravel(),
        }
    )
    p2p = {"send": (send_busy_s, np.zeros(shape)), "recv": (recv_busy_s, comm_wait_s)}
    collectives = pl.concat(
        pl.DataFrame(
            {
                "job_id": "pipeline",
                "rank": rank,
                "step": step,
                "group": "0",
                "op": op,
                "group_size": NUM_STAGES,
                "count": sends.ravel().astype(np.int64),
                "bytes": 2048 * sends.ravel().astype(np.int64),
                "busy_s": busy_s.ravel(),
                "wait_s": wait_s.ravel(),
                "first_seq": pl.Series([None] * rank.size, dtype=pl.Int64),
                "mesh_dim": "pp",
                "group_ranks": "0-3",
            }
        )
        for op, (busy_s, wait_s) in p2p.items()
    )
    ranks = pl.DataFrame(
        {
            "rank": np.arange(NUM_STAGES),
            "node": NODE,
            "mesh": [json.dumps({"pp": [r, NUM_STAGES]}) for r in range(NUM_STAGES)],
        }
    )
    return {"steps": steps, "collectives": collectives, "ranks": ranks}


def findings_of(frames: dict[str, pl.DataFrame]) -> list[Finding]:
    return analyze(
        frames["steps"],
        collectives=frames["collectives"],
        ranks=frames["ranks"],
        config=AnalysisConfig(warmup_steps=10),
    )


def stragglers(findings: list[Finding]) -> list[Finding]:
    kinds = {"straggler_rank", "straggler_node", "gpu_throttling"}
    return sorted((f for f in findings if f.kind in kinds), key=lambda f: f.first_step or 0)


@pytest.mark.parametrize("stage", range(NUM_STAGES))
def test_a_stage_slow_in_compute_is_named_and_not_the_neighbour_that_waits_for_it(
    stage: int,
) -> None:
    # The neighbour's sends last 4 × 30 ms longer a step: far more than the stage's own
    # 30 ms, and more than the whole 65 ms step.
    findings = findings_of(pipeline_steps([(stage, 120, NUM_STEPS - 1)], 0.030))

    [f] = stragglers(findings)
    assert (f.kind, f.ranks, f.cause, f.evidence["stage"]) == (
        "straggler_rank",
        [stage],
        "compute",
        stage,
    )
    assert f.first_step == pytest.approx(120, abs=2)
    assert [x for x in findings if x.kind == "slow_collective"] == []


def test_what_a_stage_costs_is_within_its_own_excess() -> None:
    frames = pipeline_steps([(2, 120, NUM_STEPS - 1)], 0.030)
    # A few long spikes on the slowed stage: the job waits for them too, but they are not
    # the stage's typical excess, which is all the finding says it costs.
    steps = frames["steps"].with_columns(
        pl.when((pl.col("rank") == 2) & (pl.col("step") % 10 == 5))
        .then(pl.col("compute_s") + 0.2)
        .otherwise(pl.col("compute_s"))
        .alias("compute_s")
    )
    [f] = stragglers(findings_of({**frames, "steps": steps}))

    assert f.observed is not None
    assert f.expected is not None
    excess_s = f.observed - f.expected
    assert excess_s == pytest.approx(0.030, rel=0.1)
    impact = f.evidence["impact"]
    assert impact["step_s"] == pytest.approx(excess_s, rel=1e-6)
    assert impact["step_share"] <= excess_s / (CLEAN_STEP_S + 0.030) * 1.02


def test_stages_of_one_node_slowed_in_turn_are_each_named_not_the_node() -> None:
    slowed = [(0, 40, 79), (1, 100, 139), (2, 160, 199)]
    found = stragglers(findings_of(pipeline_steps(slowed, 0.030)))

    assert [(f.kind, f.ranks, f.node, f.cause) for f in found] == [
        ("straggler_rank", [stage], NODE, "compute") for stage, _, _ in slowed
    ]
    # Within a few steps: the straggler test's cuts are refined to +-5 steps of a shift.
    for f, (_, first, last) in zip(found, slowed, strict=True):
        assert f.first_step == pytest.approx(first, abs=5)
        assert f.last_step == pytest.approx(last, abs=5)


def test_a_stage_heavier_by_design_is_not_a_straggler() -> None:
    # The head's stage computes 40% more than the others from the first step on: stages
    # differ by design, and one slower than the others throughout is no straggler.
    frames = pipeline_steps([(NUM_STAGES - 1, 0, NUM_STEPS - 1)], 0.4 * COMPUTE_S)
    assert stragglers(findings_of(frames)) == []
    # The same excess without pipeline stages (4 data-parallel ranks) is one.
    plain = {**frames, "ranks": frames["ranks"].drop("mesh")}
    assert [(f.ranks, f.cause) for f in stragglers(findings_of(plain))] == [
        ([NUM_STAGES - 1], "compute")
    ]


def test_a_stage_slowed_from_the_warm_ups_end_is_named_beyond_twice_the_other_stages() -> None:
    # The job: stage 2 sleeps from the first step after warm-up, +150% of its compute
    # (a stage twice the median stage holds the pipeline back, by design or not).
    frames = pipeline_steps([(2, 10, NUM_STEPS - 1)], 1.5 * COMPUTE_S)
    [f] = stragglers(findings_of(frames))
    assert (f.ranks, f.cause, f.evidence["stage"], f.first_step, f.last_step) == (
        [2],
        "compute",
        2,
        10,
        None,
    )
