"""The synthetic job generator: shapes, values, and the masking of synchronous training."""

from __future__ import annotations

import numpy as np
import pytest

from stepscope.schema import COLLECTIVES, GPU, JOBS, STEPS, busbw_bps
from stepscope.synthetic.generate import JobSpec, SlowNode, Straggler, generate, to_frames


def _matrix(job_columns: dict[str, np.ndarray], column: str, num_ranks: int) -> np.ndarray:
    return job_columns[column].reshape(num_ranks, -1)


def test_columns_use_schema_names_and_shapes() -> None:
    job = generate(JobSpec(num_ranks=16, num_steps=50, seed=1))
    assert set(job.steps) <= set(STEPS.names) - {"job_id", "node"}
    # A simulated data-parallel job: its one process group spans no DeviceMesh dimension.
    assert set(job.collectives) == set(COLLECTIVES.names) - {"job_id", "mesh_dim"}
    assert set(job.collectives["group"]) == {"0"}
    assert job.collectives["first_seq"][:3].tolist() == [0, 25, 50]
    assert set(job.gpu) <= set(GPU.names) - {"job_id"}
    assert set(job.job) == set(JOBS.names)
    assert all(v.shape == (16 * 50,) for v in job.steps.values())
    # Rows are ordered by (rank, step): one rank's rows are a contiguous slice.
    assert job.steps["rank"][:50].tolist() == [0] * 50
    assert job.steps["step"][:50].tolist() == list(range(50))
    assert job.nodes[7] == job.nodes[0] != job.nodes[8]
    assert job.job["world_size"] == 16


def test_clean_step_time_and_composition() -> None:
    spec = JobSpec(num_ranks=8, num_steps=400, noise=0.01, spike_prob=0.0, warmup_steps=10)
    job = generate(spec)
    step_s = _matrix(job.steps, "step_s", 8)[:, 10:]
    data_s = _matrix(job.steps, "data_s", 8)[:, 10:]
    # The step ends when the slowest of 8 noisy ranks is done: a little above the base.
    assert np.median(step_s) == pytest.approx(spec.base_step_s, rel=0.05)
    assert np.median(data_s) == pytest.approx(spec.data_share * spec.base_step_s, rel=0.05)
    # Warm-up steps are slower.
    assert _matrix(job.steps, "step_s", 8)[:, 0].mean() > 3 * spec.base_step_s
    # Collective busbw of the transfer itself (fastest rank) is the configured one.
    busy = _matrix(job.collectives, "busy_s", 8)[:, 10:]
    bw = busbw_bps("all_reduce", 8, spec.allreduce_bytes, float(np.median(busy.min(axis=0))))
    assert bw == pytest.approx(spec.busbw_bps, rel=0.05)


def test_compute_straggler_makes_the_others_wait() -> None:
    spec = JobSpec(
        num_ranks=8,
        num_steps=300,
        spike_prob=0.0,
        stragglers=(Straggler(ranks=(3,), factor=1.3, cause="compute", from_step=100),),
    )
    job = generate(spec)
    step_s = _matrix(job.steps, "step_s", 8)
    wait = _matrix(job.steps, "comm_wait_s", 8)
    compute = step_s - _matrix(job.steps, "data_s", 8) - wait
    # Every rank's step time is the same (within measurement jitter): the all-reduce syncs them.
    assert np.ptp(step_s[:, 150:], axis=0).max() < 0.005
    after = slice(100, None)
    assert np.median(step_s[:, after]) == pytest.approx(
        1.3 * np.median(step_s[:, 20:100]), rel=0.03
    )
    # The straggler waits the least, at every step; the others wait ~0.3 × base longer.
    assert (wait[:, after].argmin(axis=0) == 3).all()
    extra_wait = np.median(np.delete(wait[:, after], 3, axis=0)) - np.median(wait[3, after])
    assert extra_wait == pytest.approx(0.3 * spec.base_step_s, rel=0.1)
    assert np.median(compute[3, after]) - np.median(compute[0, after]) == pytest.approx(
        0.3 * spec.base_step_s, rel=0.1
    )
    assert job.truth == spec.stragglers


def test_data_communication_and_throttling_show_their_own_evidence() -> None:
    spec = JobSpec(
        num_ranks=16,
        num_steps=300,
        spike_prob=0.0,
        stragglers=(
            Straggler(ranks=(1,), factor=1.2, cause="data", from_step=50),
            Straggler(ranks=(2,), factor=1.2, cause="communication", from_step=50),
            Straggler(ranks=(5,), factor=1.2, cause="gpu_throttling", from_step=50),
        ),
    )
    job = generate(spec)
    data_s = _matrix(job.steps, "data_s", 16)[:, 60:]
    busy = _matrix(job.collectives, "busy_s", 16)[:, 60:]
    ready = (_matrix(job.steps, "step_s", 16) - _matrix(job.steps, "comm_wait_s", 16))[:, 60:]
    assert np.median(data_s[1]) - np.median(data_s[0]) == pytest.approx(0.1, rel=0.05)
    # The communication-slow rank's collectives finish later than everyone else's.
    finish = ready + busy
    assert (finish.argmax(axis=0) == 2).mean() > 0.95
    # The throttled GPU: clocks down, throttle reasons set, at the power cap, hot.
    gpu_rank = job.gpu["rank"]
    late = job.gpu["ts"] > job.steps["ts"][60]
    throttled, peer = (gpu_rank == 5) & late, (gpu_rank == 4) & late
    assert np.median(job.gpu["sm_clock_mhz"][throttled]) < 0.9 * np.median(
        job.gpu["sm_clock_mhz"][peer]
    )
    assert (job.gpu["throttle_reasons"][throttled] & 0x20).all()
    assert np.median(job.gpu["power_w"][throttled]) > 0.99 * spec.power_cap_w
    assert np.median(job.gpu["temp_c"][throttled]) > np.median(job.gpu["temp_c"][peer]) + 5


def test_slow_node_expands_to_its_ranks_and_recovers() -> None:
    spec = JobSpec(
        num_ranks=24,
        num_steps=200,
        spike_prob=0.0,
        slow_nodes=(SlowNode(node=1, factor=1.2, cause="compute", from_step=50, until_step=120),),
    )
    job = generate(spec)
    (truth,) = job.truth
    assert truth.ranks == tuple(range(8, 16))
    wait = _matrix(job.steps, "comm_wait_s", 24)
    assert np.median(wait[8:16, 60:110]) < np.median(wait[16:, 60:110]) - 0.05
    assert abs(np.median(wait[8:16, 130:]) - np.median(wait[16:, 130:])) < 0.01


def test_spikes_and_seed() -> None:
    spec = JobSpec(num_ranks=8, num_steps=2000, spike_prob=0.01, spike_factor=3.0, noise=0.0)
    a, b = generate(spec), generate(spec)
    assert np.array_equal(a.steps["step_s"], b.steps["step_s"])
    step_s = _matrix(a.steps, "step_s", 8)[0, 20:]
    spiky = step_s > 2 * spec.base_step_s
    # ~1 - 0.99^8 of steps have a spike on some rank; the others stay at the base.
    assert 0.04 < spiky.mean() < 0.12


def test_to_frames_adds_job_id_and_node() -> None:
    job = generate(JobSpec(job_id="j1", num_ranks=16, num_steps=20))
    frames = to_frames(job)
    steps = frames["steps"]
    assert steps.columns == [c for c in STEPS.names if c in steps.columns]
    assert steps["job_id"].unique().to_list() == ["j1"]
    assert steps.filter(steps["rank"] == 9)["node"].unique().to_list() == [job.nodes[9]]
    assert frames["collectives"].height == 16 * 20
    assert frames["ranks"]["node"].to_list() == job.nodes
    assert frames["jobs"]["world_size"].to_list() == [16]


def test_large_job_generates_quickly() -> None:
    import time

    t = time.perf_counter()
    job = generate(JobSpec(num_ranks=256, num_steps=2000, with_gpu=False))
    assert job.steps["step_s"].size == 512_000
    assert time.perf_counter() - t < 10
