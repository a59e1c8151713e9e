"""Straggler findings on synthetic jobs with known injected slowdowns."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from stepscope.analysis import AnalysisConfig, analyze
from stepscope.analysis.stragglers.findings import StragglerInput, straggler_findings
from stepscope.schema import Finding
from stepscope.synthetic.generate import JobSpec, SlowNode, Straggler, generate, to_frames
from stepscope.text.findings import finding_line


def _analyze(spec: JobSpec, *, drop: tuple[str, ...] = (), **kwargs: object) -> list[Finding]:
    frames = to_frames(generate(spec))
    return analyze(
        frames["steps"].drop(*drop),
        collectives=frames.get("collectives"),
        gpu=frames.get("gpu"),
        **kwargs,  # type: ignore[arg-type]
    )


def _stragglers(findings: list[Finding]) -> list[Finding]:
    kinds = {"straggler_rank", "straggler_node", "gpu_throttling"}
    return [f for f in findings if f.kind in kinds]


def _spec(*stragglers: Straggler, **kwargs: object) -> JobSpec:
    defaults: dict[str, object] = {"num_ranks": 32, "num_steps": 600, "seed": 7}
    return JobSpec(stragglers=stragglers, **{**defaults, **kwargs})  # type: ignore[arg-type]


def test_compute_delay_names_the_slow_rank_and_when() -> None:
    spec = _spec(Straggler(ranks=(5,), factor=1.2, cause="compute", from_step=200, until_step=400))
    (f,) = _stragglers(_analyze(spec))
    assert (f.kind, f.ranks, f.cause, f.node) == ("straggler_rank", [5], "compute", "node-0000")
    assert f.first_step == pytest.approx(200, abs=2)
    assert f.last_step == pytest.approx(399, abs=2)
    assert f.effect == pytest.approx(0.2, abs=0.02)
    assert f.severity == "warning"
    assert f.metric == "step_s"
    assert f.expected is not None
    assert f.effect is not None
    assert f.observed == pytest.approx(f.expected * (1 + f.effect))
    # The slow rank waits least in the all-reduce; its peers wait for it.
    wait = f.evidence["comm_wait_s"]
    assert wait["peers"] - wait["rank"] == pytest.approx(0.1, rel=0.15)
    assert f.evidence["gpu"]["throttled"] is False
    assert 200 < f.evidence["detected_step"] <= 250


def test_data_delay_is_caused_by_data_and_still_ongoing() -> None:
    spec = _spec(Straggler(ranks=(17,), factor=1.1, cause="data", from_step=300))
    (f,) = _stragglers(_analyze(spec))
    assert (f.ranks, f.cause, f.last_step) == ([17], "data", None)
    assert f.first_step == pytest.approx(300, abs=2)
    assert f.effect == pytest.approx(0.1, abs=0.015)
    assert f.evidence["component"] == "data_s"
    assert f.evidence["last_seen_step"] == 599


def test_communication_delay_is_found_in_the_collectives() -> None:
    spec = _spec(Straggler(ranks=(9,), factor=1.08, cause="communication", from_step=100))
    (f,) = _stragglers(_analyze(spec))
    assert (f.ranks, f.cause) == ([9], "communication")
    assert f.effect == pytest.approx(0.08, abs=0.015)
    bw = f.evidence["collectives"]["all_reduce"]
    assert bw["rank_busbw_bps"] < bw["peers_busbw_bps"]


def test_throttled_gpu_is_reported_as_gpu_throttling() -> None:
    spec = _spec(Straggler(ranks=(12,), factor=1.15, cause="gpu_throttling", from_step=150))
    (f,) = _stragglers(_analyze(spec))
    assert (f.kind, f.cause, f.ranks) == ("gpu_throttling", "gpu_throttling", [12])
    gpu = f.evidence["gpu"]
    assert gpu["throttled"] is True
    assert gpu["sm_clock_mhz"]["rank"] < 0.9 * gpu["sm_clock_mhz"]["peers"]
    assert gpu["slowdown_share"]["rank"] > 0.9
    assert gpu["temp_c"]["rank"] > gpu["temp_c"]["peers"]


def test_without_telemetry_throttling_is_a_compute_straggler() -> None:
    spec = _spec(
        Straggler(ranks=(12,), factor=1.15, cause="gpu_throttling", from_step=150),
        with_gpu=False,
    )
    (f,) = _stragglers(_analyze(spec))
    assert (f.kind, f.cause) == ("straggler_rank", "compute")


def test_most_of_a_node_slow_is_one_node_finding() -> None:
    spec = JobSpec(
        num_ranks=32,
        num_steps=600,
        seed=3,
        slow_nodes=(SlowNode(node=2, factor=1.3, cause="compute", from_step=200),),
    )
    (f,) = _stragglers(_analyze(spec))
    assert (f.kind, f.node, f.ranks, f.cause) == (
        "straggler_node",
        "node-0002",
        list(range(16, 24)),
        "compute",
    )
    assert f.effect == pytest.approx(0.3, abs=0.03)
    assert f.severity == "critical"
    assert f.evidence["ranks_flagged"] == 8


def test_several_slow_ranks_each_get_a_finding() -> None:
    spec = _spec(
        Straggler(ranks=(1,), factor=1.05, cause="compute", from_step=100),
        Straggler(ranks=(20, 30), factor=1.5, cause="data", from_step=300, until_step=360),
    )
    found = {f.ranks[0]: f for f in _stragglers(_analyze(spec))}
    assert sorted(found) == [1, 20, 30]
    assert found[1].effect == pytest.approx(0.05, abs=0.015)
    assert found[20].cause == found[30].cause == "data"
    assert found[30].first_step == pytest.approx(300, abs=2)
    assert found[30].last_step == pytest.approx(359, abs=3)
    assert found[30].severity == "critical"


@pytest.mark.parametrize(
    ("num_ranks", "spike_prob", "seed"), [(64, 0.01, 0), (64, 0.01, 1), (256, 0.002, 2)]
)
def test_clean_noisy_spiky_runs_have_no_findings(
    num_ranks: int, spike_prob: float, seed: int
) -> None:
    # With these ranks and spike rates, 30-50% of the job's steps hold a spike on some rank:
    # the job's step time (the slowest rank's) jumps between two levels at random.
    spec = JobSpec(num_ranks=num_ranks, num_steps=600, noise=0.04, spike_prob=spike_prob, seed=seed)
    job = generate(spec)
    frames = to_frames(job)

    findings = analyze(
        frames["steps"], collectives=frames["collectives"], gpu=frames["gpu"], job=job.job
    )

    assert [(f.kind, f.ranks, f.first_step) for f in findings] == []


def test_a_short_small_slowdown_is_not_a_straggler() -> None:
    spec = _spec(Straggler(ranks=(4,), factor=1.03, cause="compute", from_step=200, until_step=215))
    assert _stragglers(_analyze(spec)) == []


def test_a_short_large_slowdown_is_named_for_its_steps() -> None:
    # The time to a verdict scales with the slowdown against the noise: 15 steps at 2x are
    # as much evidence as 30 steps of a just-significant slowdown, and far more.
    spec = _spec(Straggler(ranks=(4,), factor=2.0, cause="compute", from_step=200, until_step=215))
    found = _stragglers(_analyze(spec))
    assert [(f.kind, f.ranks, f.cause, f.first_step, f.last_step) for f in found] == [
        ("straggler_rank", [4], "compute", 200, 214)
    ]


def test_warmup_is_skipped() -> None:
    spec = _spec(warmup_steps=30, noise=0.05)
    assert _stragglers(_analyze(spec, config=AnalysisConfig(warmup_steps=40))) == []


def test_without_comm_wait_the_cause_is_unknown() -> None:
    spec = _spec(Straggler(ranks=(6,), factor=1.2, cause="compute", from_step=100))
    found = _stragglers(_analyze(spec, drop=("comm_wait_s",)))
    # compute_s = step_s - data_s then includes the wait: synchronous ranks all look alike,
    # so only a data straggler or unsynchronised ranks can stand out.
    assert all(f.cause in ("unknown", "data") for f in found)


def test_row_order_and_missing_rows_do_not_change_the_findings() -> None:
    spec = _spec(Straggler(ranks=(5,), factor=1.2, cause="compute", from_step=200))
    frames = to_frames(generate(spec))
    steps = frames["steps"]
    by_step = steps.sort("step", "rank")
    shuffled = steps.sample(fraction=1.0, shuffle=True, seed=1).filter(
        ~((pl.col("rank") == 0) & (pl.col("step") % 7 == 0))
    )
    results = []
    for frame in (steps, by_step, shuffled):
        (f,) = _stragglers(analyze(frame, collectives=frames["collectives"]))
        results.append((f.ranks, f.cause, f.first_step, round(f.effect or 0, 2)))
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize(
    ("jitter", "rank_bias", "spike_prob"),
    [("normal", 0.005, 1e-4), ("lognormal", 0.0, 1e-3), ("ar1", 0.0, 1e-3)],
)
@pytest.mark.parametrize("seed", [1, 2])
def test_a_3_percent_slowdown_is_found_at_its_onset_under_each_noise_model(
    jitter: str, rank_bias: float, spike_prob: float, seed: int
) -> None:
    # 3% of the rank's compute under 2% per-step noise: 1.5 sigma per step, and no step of
    # the straggler stands out on its own.
    spec = JobSpec(num_ranks=32, num_steps=400, noise=0.02, seed=seed)
    compute_s = spec.base_step_s * (1 - spec.data_share) - spec.transfer_s
    factor = 1 + 0.03 * compute_s / spec.base_step_s
    spec = _spec(
        Straggler(ranks=(11,), factor=factor, cause="compute", from_step=150),
        num_steps=400,
        noise=0.02,
        jitter=jitter,
        rank_bias=rank_bias,
        spike_prob=spike_prob,
        seed=seed,
    )

    (f,) = _stragglers(_analyze(spec))

    assert (f.kind, f.ranks, f.cause, f.last_step) == ("straggler_rank", [11], "compute", None)
    assert f.first_step == pytest.approx(150, abs=20)
    assert f.evidence["excess_s"]["compute_s"] == pytest.approx(0.03 * compute_s, rel=0.3)
    assert f.evidence["detected_step"] - 150 <= 100


@pytest.mark.parametrize("jitter", ["normal", "lognormal", "ar1"])
def test_clean_jobs_under_each_noise_model_have_no_findings(jitter: str) -> None:
    for seed in range(3):
        spec = _spec(num_steps=400, jitter=jitter, rank_bias=0.0, spike_prob=1e-3, seed=seed)
        findings = [f for f in _analyze(spec) if f.kind != "peak_unknown"]  # no peak given
        assert [(f.kind, f.ranks) for f in findings] == []


def _synchronous_steps(ready_s: np.ndarray, transfer_s: float) -> pl.DataFrame:
    """Steps of ranks that meet at an all-reduce after `ready_s` (steps × ranks) seconds."""
    num_steps, num_ranks = ready_s.shape
    step_s = ready_s.max(axis=1, keepdims=True) + transfer_s + np.zeros_like(ready_s)
    return pl.DataFrame(
        {
            "job_id": "crafted",
            "rank": np.tile(np.arange(num_ranks), num_steps),
            "step": np.repeat(np.arange(num_steps), num_ranks),
            "step_s": step_s.ravel(),
            "data_s": np.full(ready_s.size, 0.01),
            "comm_wait_s": (step_s - ready_s).ravel(),
        }
    )


def test_impact_is_the_job_step_time_lost_to_the_rank() -> None:
    rng = np.random.default_rng(3)
    ready_s = 0.2 * (1 + 0.01 * rng.standard_normal((300, 8)))
    ready_s[100:, 5] += 0.2 * 0.03  # 3% slower from step 100: not the slowest in every step
    transfer_s = 0.02

    (f,) = _stragglers(analyze(_synchronous_steps(ready_s, transfer_s)))

    assert (f.ranks, f.cause) == ([5], "compute")
    assert f.first_step == pytest.approx(100, abs=2)
    # By hand: the job's step with rank 5 against without it (the others' latest arrival).
    span = slice(f.first_step, None)
    with_rank = ready_s[span].max(axis=1) + transfer_s
    without_rank = np.delete(ready_s[span], 5, axis=1).max(axis=1) + transfer_s
    share = (with_rank - without_rank).sum() / with_rank.sum()
    assert 0.002 < share < 0.03
    impact = f.evidence["impact"]
    assert impact["step_share"] == pytest.approx(share, rel=1e-3)
    assert impact["step_s"] == pytest.approx((with_rank - without_rank).mean(), rel=1e-3)
    assert impact["gpus"] == pytest.approx(8 * share, rel=1e-3)
    assert f.severity == ("warning" if share >= 0.01 else "info")
    # The one-line text says it too.
    assert finding_line(f).endswith(f"job cost {share:.1%}, {8 * share:.1f} GPUs")


def test_ranks_slow_together_share_what_they_cost() -> None:
    rng = np.random.default_rng(4)
    ready_s = 0.2 * (1 + 0.005 * rng.standard_normal((300, 16)))
    ready_s[100:, 3] += 0.02  # 10% slower
    ready_s[100:, 9] += 0.01  # 5% slower: only costs the job when rank 3 is not there
    transfer_s = 0.02

    found = {f.ranks[0]: f for f in _stragglers(analyze(_synchronous_steps(ready_s, transfer_s)))}

    assert sorted(found) == [3, 9]
    span = slice(100, None)
    with_both = ready_s[span].max(axis=1) + transfer_s
    without_both = np.delete(ready_s[span], [3, 9], axis=1).max(axis=1) + transfer_s
    lost = {r: f.evidence["impact"]["step_s"] for r, f in found.items()}
    # Each pays alone for its own stretch, the stretch both reach is split between them.
    assert lost[3] + lost[9] == pytest.approx((with_both - without_both).mean(), rel=0.02)
    assert lost[3] == pytest.approx(lost[9] + 0.01, rel=0.1)
    assert found[3].severity == "warning"


def test_severity_follows_what_the_straggler_costs_the_job() -> None:
    # The same 5% slowdown: among 64 noisy ranks the slowest peer is often slower still, so
    # it costs the job little; among quiet ranks the job waits for it at every step.
    slow = Straggler(ranks=(7,), factor=1.05, cause="compute", from_step=150)
    noisy = _stragglers(_analyze(_spec(slow, num_ranks=64, noise=0.03, num_steps=400)))
    quiet = _stragglers(_analyze(_spec(slow, num_ranks=64, noise=0.002, num_steps=400)))

    (noisy_f,), (quiet_f,) = noisy, quiet
    assert noisy_f.effect == pytest.approx(quiet_f.effect, abs=0.01)
    assert (
        noisy_f.evidence["impact"]["step_share"] < 0.01 <= quiet_f.evidence["impact"]["step_share"]
    )
    assert quiet_f.evidence["impact"]["gpus"] == pytest.approx(
        64 * quiet_f.evidence["impact"]["step_share"]
    )
    assert (noisy_f.severity, quiet_f.severity) == ("info", "warning")


@pytest.mark.parametrize(
    ("seed", "num_ranks", "last_step"),
    [(3, 16, 99), (3, 16, 309), (14, 16, 99), (30, 32, 99), (32, 32, 99), (36, 32, 99)],
)
def test_a_live_jobs_ragged_last_steps_make_no_straggler_after_warm_up(
    seed: int, num_ranks: int, last_step: int
) -> None:
    # A live job's ranks have sent up to 20 steps more or fewer than the others. Compared in
    # the steps few ranks reported, a clean rank with a small hardware offset sat below its
    # usual level, and was a +1.4-1.9% "own" straggler from step 20 (the warm-up's end) to
    # shortly before the tail (steps 20..57-77 in jobs of ~100 steps), in these jobs.
    spec = JobSpec(num_ranks=num_ranks, num_steps=last_step + 40, seed=seed, with_gpu=False)
    frames = to_frames(generate(spec))
    rng = np.random.default_rng(seed)
    ends = pl.DataFrame(
        {"rank": np.arange(num_ranks), "end": last_step + 10 * rng.integers(-2, 3, num_ranks)}
    )

    def sent(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.join(ends, on="rank").filter(pl.col("step") <= pl.col("end")).drop("end")

    found = analyze(sent(frames["steps"]), collectives=sent(frames["collectives"]))
    assert [(f.kind, f.ranks, f.first_step, f.last_step) for f in _stragglers(found)] == []


def _channel_stragglers(
    compute_s: float, finish_s: float, neighbour_finish_s: float = 0.0
) -> list[Finding]:
    """straggler_findings of 4 ranks × 200 steps in which, from step 100, rank 2 computes
    `compute_s` longer and its collectives finish `finish_s` later (relative to the step),
    rank 1's `neighbour_finish_s` later."""
    rng = np.random.default_rng(3)
    shape = (200, 4)
    late = np.zeros(shape, dtype=np.float32)
    late[100:, 2] = 1.0
    compute = (0.5 + 0.005 * rng.standard_normal(shape) + compute_s * late).astype(np.float32)
    data = (0.01 + 0.0005 * rng.standard_normal(shape)).astype(np.float32)
    finish = (0.6 + 0.005 * rng.standard_normal(shape) + finish_s * late).astype(np.float32)
    finish[100:, 1] += neighbour_finish_s
    step_s = np.full(shape, 0.7 + compute_s + finish_s, dtype=np.float32)
    data_in = StragglerInput(
        job_id="channels",
        ranks=np.arange(4, dtype=np.int64),
        steps=np.arange(200, dtype=np.int64),
        step_s=step_s,
        reference_step_s=step_s[:, 0],
        channels={"compute": compute, "data": data, "communication": finish},
    )
    return straggler_findings(data_in, AnalysisConfig())


def test_a_rank_late_at_its_collectives_is_slow_in_compute_not_communication() -> None:
    # A pipeline stage slow in compute sends late: its collectives finish as late, and a
    # little more. The transfer is not what is slow.
    [f] = _channel_stragglers(compute_s=0.2, finish_s=0.25)
    assert (f.ranks, f.cause, f.first_step) == ([2], "compute", 100)
    assert f.evidence["excess_s"] == pytest.approx(
        {"compute_s": 0.2, "collective_finish_s": 0.25}, abs=0.01
    )
    assert f.effect is not None
    assert f.expected is not None
    assert f.effect * f.expected == pytest.approx(0.25, abs=0.01)  # not 0.2 + 0.25


def test_collectives_late_beyond_the_ranks_compute_are_a_communication_straggler() -> None:
    [f] = _channel_stragglers(compute_s=0.1, finish_s=0.4)
    assert (f.ranks, f.cause) == ([2], "communication")
    [f] = _channel_stragglers(compute_s=0.0, finish_s=0.2)
    assert (f.ranks, f.cause) == ([2], "communication")


def test_a_pipeline_neighbour_that_waited_for_a_late_stage_is_not_a_straggler() -> None:
    # Stage 1 sends to and receives from stage 2, which computes 0.2 s late: stage 1's
    # collectives finish about as late. Finishing later than that is a slow transfer.
    [f] = _channel_stragglers(compute_s=0.2, finish_s=0.22, neighbour_finish_s=0.2)
    assert (f.ranks, f.cause) == ([2], "compute")
    found = _channel_stragglers(compute_s=0.2, finish_s=0.22, neighbour_finish_s=0.4)
    assert [(f.ranks, f.cause) for f in found] == [([1], "communication"), ([2], "compute")]
