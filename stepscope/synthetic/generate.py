"""Synthetic training jobs with known stragglers, for demos, tests and benchmarks (numpy only).

The model is synchronous data parallelism. On every step each rank waits for its batch
(`data`), computes (`compute`), then joins an all-reduce that cannot finish before the
last rank arrives:

    ready[r]   = data[r] + compute[r]             when rank r reaches the all-reduce
    arrival    = max over ranks of ready          the collective can complete from here
    finish[r]  = arrival + transfer[r]            its own transfer done
    end        = max over ranks of finish         the step ends together on every rank

so every rank's `step_s` is about `end`, and a rank that is slow to compute or to load data
makes the *others* wait: its `comm_wait_s` (end - ready) is the smallest. A
communication-slow rank has a longer `transfer`, which shows as a longer all_reduce
`busy_s` (lower busbw) than its peers'; the peers' extra wait for it lands in their
`comm_wait_s`. GPU throttling is a compute slowdown with NVML evidence: clocks-event
reasons set, lower SM clock, power at the cap and a hot GPU.

Arrays are generated as (steps, ranks) matrices and returned as flat columns ordered by
(rank, step), so one rank's rows are a contiguous slice.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray

from stepscope.schema import COLLECTIVES, GPU, JOBS, RANKS, STEPS, busbw_factor, compact_ranks

if TYPE_CHECKING:
    import polars as pl

Cause = Literal["data", "compute", "communication", "gpu_throttling"]
Jitter = Literal["normal", "lognormal", "ar1"]
Columns = dict[str, NDArray[Any]]

SYNTH_GROUP = "0"
"""The process group of every collective: the default (world) group, as pg.group_name."""

SW_POWER_CAP = 0x4
SW_THERMAL_SLOWDOWN = 0x20
"""NVML clocks-event reasons used by the generator (nvmlClocksEventReason*)."""


@dataclass(kw_only=True, slots=True)
class Straggler:
    """Ranks made slower from `from_step` until `until_step` (exclusive; None: to the end)."""

    ranks: tuple[int, ...]
    factor: float
    """Step-time factor on those ranks: 1.2 makes their step 20% slower than a clean one."""
    cause: Cause
    from_step: int
    until_step: int | None = None

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("a straggler needs at least one rank")
        if self.factor < 1.0:
            raise ValueError("factor must be >= 1 (1.2 = 20% slower)")
        if self.cause not in ("data", "compute", "communication", "gpu_throttling"):
            raise ValueError(f"unknown cause {self.cause!r}")
        if self.until_step is not None and self.until_step <= self.from_step:
            raise ValueError("until_step must be after from_step")


@dataclass(kw_only=True, slots=True)
class SlowNode:
    """Every rank of node number `node` (rank // ranks_per_node) made slower, as a Straggler."""

    node: int
    factor: float
    cause: Cause
    from_step: int
    until_step: int | None = None


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """What to simulate: size, timing, noise, and the slowdowns to inject."""

    job_id: str = "synth"
    num_ranks: int = 8
    num_steps: int = 1000
    ranks_per_node: int = 8
    base_step_s: float = 0.5
    """Clean step time (data + compute + non-overlapped all-reduce)."""
    data_share: float = 0.02
    """Share of the clean step spent waiting for data."""
    noise: float = 0.02
    """Relative per-rank per-step noise of data, compute and transfer times."""
    jitter: Jitter = "normal"
    """How that noise is drawn: normal (independent steps), lognormal (independent, skewed
    to slow steps), or ar1 (each rank's noise AR(1)-correlated over steps, heavy-tailed)."""
    jitter_rho: float = 0.6
    """Lag-1 correlation of the ar1 noise."""
    jitter_df: float = 3.0
    """Degrees of freedom of the ar1 noise's Student-t innovations (heavy tails)."""
    rank_bias: float = 0.005
    """Relative per-rank persistent compute offset (hardware is never perfectly equal)."""
    spike_prob: float = 1e-4
    """Probability that a (rank, step) has a one-step spike (in data or compute)."""
    spike_factor: float = 3.0
    """A spike adds (spike_factor - 1) × base_step_s to that rank's step."""
    warmup_steps: int = 10
    """First steps are slower (compilation, autotuning, cache warm-up) and noisier."""
    drift: float = 0.0
    """The job's compute wanders slowly (a random walk) by about this relative amount (its
    standard deviation), each rank's by 0.6 of it on top: clocks, temperatures and inputs
    are never quite steady."""
    stragglers: tuple[Straggler, ...] = ()
    slow_nodes: tuple[SlowNode, ...] = ()
    throughput_shifts: tuple[tuple[int, float], ...] = ()
    """(step, factor): from `step` on, every rank's compute and data take `factor` × longer."""
    busbw_shifts: tuple[tuple[int, float], ...] = ()
    """(step, factor): from `step` on, the job's all-reduce bus bandwidth is × `factor`."""
    allreduce_bytes: int = 1_000_000_000
    """Gradient bytes all-reduced per rank per step."""
    num_buckets: int = 25
    """DDP gradient buckets: all_reduce calls per step."""
    busbw_bps: float = 100e9
    """Clean all-reduce bus bandwidth."""
    tokens_per_step: int = 16384
    """Tokens per rank per step."""
    samples_per_step: int = 8
    flops_per_step: float | None = 3.0e14
    """Model FLOPs per rank per step (None: no flops column)."""
    peak_flops: float | None = 9.89e14
    device_name: str = "NVIDIA H100 80GB HBM3"
    power_cap_w: float = 700.0
    max_sm_clock_mhz: float = 1980.0
    gpu_interval_s: float = 1.0
    """GPU telemetry sampling period."""
    start_ts: float = 1.7e9
    seed: int = 0
    hosts: tuple[str, ...] = ()
    """Host of each node number (ranks_per_node ranks at a time, in order), which then also
    get GPU UUIDs; default node-0000, node-0001, … without UUIDs."""
    with_gpu: bool = True
    with_collectives: bool = True

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.num_steps < 1 or self.ranks_per_node < 1:
            raise ValueError("num_ranks, num_steps and ranks_per_node must be >= 1")
        if self.jitter not in ("normal", "lognormal", "ar1"):
            raise ValueError(f"unknown jitter {self.jitter!r}")
        if not -1 < self.jitter_rho < 1 or self.jitter_df <= 2:
            raise ValueError("jitter_rho must be in (-1, 1) and jitter_df > 2")
        if self.base_step_s <= 0 or self.noise < 0 or self.rank_bias < 0 or self.drift < 0:
            raise ValueError("base_step_s must be > 0, noise, rank_bias and drift >= 0")
        if not 0 <= self.data_share < 0.5:
            raise ValueError("data_share must be in [0, 0.5)")
        if not 0 <= self.spike_prob <= 1 or self.spike_factor < 1:
            raise ValueError("spike_prob must be in [0, 1] and spike_factor >= 1")
        if self.transfer_s > 0.5 * self.base_step_s:
            raise ValueError("the all-reduce takes more than half the step: raise busbw_bps")
        for s in self.stragglers:
            if max(s.ranks) >= self.num_ranks or min(s.ranks) < 0:
                raise ValueError(f"straggler ranks {s.ranks} outside 0..{self.num_ranks - 1}")
        if self.hosts and len(self.hosts) < self.num_nodes:
            raise ValueError(
                f"{self.num_ranks} ranks at {self.ranks_per_node} per node need "
                f"{self.num_nodes} hosts; {len(self.hosts)} given"
            )
        for n in self.slow_nodes:
            if not 0 <= n.node < self.num_nodes:
                raise ValueError(f"slow node {n.node} outside 0..{self.num_nodes - 1}")

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.num_ranks / self.ranks_per_node)

    @property
    def transfer_s(self) -> float:
        """Clean non-overlapped all-reduce time."""
        factor = busbw_factor("all_reduce", self.num_ranks) if self.num_ranks > 1 else 1.0
        return self.allreduce_bytes * factor / self.busbw_bps

    def node_host(self, node: int) -> str:
        """The host name of node number `node`."""
        return self.hosts[node] if self.hosts else node_name(node)

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """Ranks placed on node number `node`."""
        first = node * self.ranks_per_node
        return tuple(range(first, min(first + self.ranks_per_node, self.num_ranks)))

    def all_stragglers(self) -> tuple[Straggler, ...]:
        """The stragglers, with each slow node expanded to a Straggler on its ranks."""
        from_nodes = tuple(
            Straggler(
                ranks=self.node_ranks(n.node),
                factor=n.factor,
                cause=n.cause,
                from_step=n.from_step,
                until_step=n.until_step,
            )
            for n in self.slow_nodes
        )
        return self.stragglers + from_nodes


@dataclass(kw_only=True, slots=True)
class SynthJob:
    """Generated records as numpy columns named as in stepscope.schema (no job_id)."""

    spec: JobSpec
    steps: Columns
    collectives: Columns
    gpu: Columns
    nodes: list[str]
    """Host name of each rank."""
    job: dict[str, Any]
    """A row of the jobs table."""
    truth: tuple[Straggler, ...] = field(default_factory=tuple)
    """The injected stragglers (slow nodes expanded to their ranks)."""
    gpus: list[str] | None = None
    """GPU UUID of each rank (with spec.hosts), sent as source.attributes["gpu.uuid"]."""


def node_name(node: int) -> str:
    return f"node-{node:04d}"


def generate(spec: JobSpec) -> SynthJob:
    """Simulate `spec`: steps, collectives and GPU samples of every rank."""
    rng = np.random.default_rng(spec.seed)
    num_steps, num_ranks = spec.num_steps, spec.num_ranks
    # (ranks, steps) matrices: flattening them gives columns ordered by (rank, step).
    shape = (num_ranks, num_steps)

    level = _level(num_steps, spec.throughput_shifts)
    bw_level = _level(num_steps, spec.busbw_shifts)
    warm = np.ones(num_steps)
    if spec.warmup_steps > 0:
        w = min(spec.warmup_steps, num_steps)
        warm[:w] = 1.0 + 4.0 * (1.0 - np.arange(w) / spec.warmup_steps) ** 2
    noise = np.full(num_steps, spec.noise, dtype=np.float32)
    noise[: spec.warmup_steps] *= 3.0

    data0 = spec.data_share * spec.base_step_s
    transfer0 = spec.transfer_s
    compute0 = spec.base_step_s - data0 - transfer0
    bias = 1.0 + spec.rank_bias * rng.standard_normal(num_ranks)

    def jitter() -> NDArray[np.float32]:
        z = _noise(rng, shape, spec)
        if spec.jitter == "lognormal":
            return np.exp(z * noise - 0.5 * noise * noise).astype(np.float32)
        z *= noise
        z += 1.0
        return np.maximum(z, np.float32(0.2), out=z)

    compute = (compute0 * level * warm)[None, :] * bias[:, None] * jitter()
    if spec.drift > 0:
        compute *= 1.0 + spec.drift * (_wander(rng, (1, num_steps)) + 0.6 * _wander(rng, shape))
    data = (data0 * level * warm)[None, :] * jitter()
    transfer = (transfer0 / bw_level)[None, :] * jitter()

    extra_compute = np.zeros(shape, dtype=np.float32) if spec.with_gpu else None
    for s in spec.all_stragglers():
        cols = slice(s.from_step, s.until_step)
        rows = np.asarray(s.ranks)[:, None]
        extra = (s.factor - 1.0) * spec.base_step_s * level[cols]
        target = {"data": data, "communication": transfer}.get(s.cause, compute)
        target[rows, np.arange(num_steps)[cols]] += extra
        if s.cause == "gpu_throttling" and extra_compute is not None:
            extra_compute[rows, np.arange(num_steps)[cols]] += extra

    if spec.spike_prob > 0:
        spikes = np.flatnonzero(rng.random(shape, dtype=np.float32) < spec.spike_prob)
        in_data = rng.random(spikes.size) < 0.5
        spike_s = (spec.spike_factor - 1.0) * spec.base_step_s
        data.ravel()[spikes[in_data]] += spike_s
        compute.ravel()[spikes[~in_data]] += spike_s

    ready = data + compute
    arrival = ready.max(axis=0)
    finish = transfer + arrival[None, :]
    end = finish.max(axis=0)
    measure = np.abs(rng.standard_normal(shape, dtype=np.float32)) * np.float32(2e-4)
    step_s = measure + end[None, :]
    comm_wait = step_s - ready
    busy = finish - ready
    starts = spec.start_ts + np.concatenate(([0.0], np.cumsum(end)[:-1]))
    ts = rng.random(shape, dtype=np.float32) * np.float32(1e-3) + starts[None, :]

    n = num_ranks * num_steps
    rank_col = np.repeat(np.arange(num_ranks, dtype=np.int64), num_steps)
    step_col = np.tile(np.arange(num_steps, dtype=np.int64), num_ranks)
    steps: Columns = {
        "rank": rank_col,
        "step": step_col,
        "ts": ts.ravel(),
        "step_s": step_s.ravel(),
        "data_s": data.ravel(),
        "comm_s": (busy + measure).ravel(),
        "comm_wait_s": comm_wait.ravel(),
        "tokens": np.full(n, spec.tokens_per_step, dtype=np.int64),
        "samples": np.full(n, spec.samples_per_step, dtype=np.int64),
    }
    if spec.flops_per_step is not None:
        steps["flops"] = np.full(n, spec.flops_per_step, dtype=np.float64)
    steps["mem_peak_bytes"] = np.repeat(
        (60e9 * (1.0 + 0.01 * rng.random(num_ranks))).astype(np.int64), num_steps
    )

    collectives: Columns = {}
    if spec.with_collectives:
        collectives = {
            "rank": rank_col,
            "step": step_col,
            "group": np.full(n, SYNTH_GROUP, dtype=object),
            "op": np.full(n, "all_reduce", dtype=object),
            "group_size": np.full(n, num_ranks, dtype=np.int64),
            "count": np.full(n, spec.num_buckets, dtype=np.int64),
            "bytes": np.full(n, spec.allreduce_bytes, dtype=np.int64),
            "busy_s": busy.ravel(),
            # Synchronous all-reduces, not overlapped: the thread is blocked for all of them.
            "wait_s": busy.ravel().copy(),
            # The group's only collectives: the step's first is the group's call num_buckets × step.
            "first_seq": step_col * spec.num_buckets,
            "group_ranks": np.full(n, compact_ranks(list(range(num_ranks))), dtype=object),
        }

    gpu: Columns = {}
    if extra_compute is not None:
        gpu = _gpu_samples(spec, rng, starts, end, compute, extra_compute, compute0 * level)

    nodes = [spec.node_host(r // spec.ranks_per_node) for r in range(num_ranks)]
    gpus = None
    if spec.hosts:
        gpus = [f"GPU-sim-{nodes[r]}-{r % spec.ranks_per_node}" for r in range(num_ranks)]
    ended_at = float(starts[-1] + end[-1])
    job = {
        "job_id": spec.job_id,
        "name": f"synthetic {num_ranks}x{num_steps}",
        "benchmark_key": f"synth/{num_ranks}",
        "world_size": num_ranks,
        "device_name": spec.device_name,
        "peak_flops": spec.peak_flops,
        "started_at": spec.start_ts,
        "ended_at": ended_at,
        "status": "finished",
        "attributes": {"synthetic": True, "seed": spec.seed},
    }
    assert set(job) == set(JOBS.names)
    return SynthJob(
        spec=spec,
        steps=steps,
        collectives=collectives,
        gpu=gpu,
        nodes=nodes,
        job=job,
        truth=spec.all_stragglers(),
        gpus=gpus,
    )


def _noise(rng: np.random.Generator, shape: tuple[int, int], spec: JobSpec) -> NDArray[np.float32]:
    """(ranks, steps) noise of standard deviation 1, independent or AR(1) along the steps."""
    if spec.jitter != "ar1":
        return rng.standard_normal(shape, dtype=np.float32)
    rho, df = spec.jitter_rho, spec.jitter_df
    # Student-t innovations scaled to a stationary standard deviation of 1.
    scale = math.sqrt((1.0 - rho * rho) * (df - 2.0) / df)
    innovations = rng.standard_t(df, size=shape) * scale
    z = np.empty(shape, dtype=np.float32)
    z[:, 0] = rng.standard_normal(shape[0])
    for t in range(1, shape[1]):
        z[:, t] = rho * z[:, t - 1] + innovations[:, t]
    return z


def _wander(rng: np.random.Generator, shape: tuple[int, int]) -> NDArray[np.float64]:
    """Random walks along the last axis, each centred and scaled to a standard deviation of 1
    (over hundreds of steps one step moves it little: a slow wander)."""
    walk = np.cumsum(rng.standard_normal(shape), axis=1)
    walk -= walk.mean(axis=1, keepdims=True)
    sd = walk.std(axis=1, keepdims=True)
    return walk / np.where(sd > 0, sd, 1.0)


def _level(num_steps: int, shifts: tuple[tuple[int, float], ...]) -> NDArray[np.float64]:
    level = np.ones(num_steps)
    for step, factor in shifts:
        level[step:] *= factor
    return level


def _gpu_samples(
    spec: JobSpec,
    rng: np.random.Generator,
    starts: NDArray[np.float64],
    end: NDArray[np.float64],
    compute: NDArray[np.float64],
    extra_compute: NDArray[np.float32],
    clean_compute: NDArray[np.float64],
) -> Columns:
    """NVML-like samples every gpu_interval_s on every rank, following the step timeline."""
    duration = float(starts[-1] + end[-1] - spec.start_ts)
    num_samples = max(1, int(duration / spec.gpu_interval_s))
    num_ranks = spec.num_ranks
    shape = (num_ranks, num_samples)
    offsets = rng.random(num_ranks) * spec.gpu_interval_s
    ts = spec.start_ts + offsets[:, None] + np.arange(num_samples)[None, :] * spec.gpu_interval_s
    at_step = np.searchsorted(starts, ts.ravel(), side="right").reshape(shape) - 1
    np.clip(at_step, 0, spec.num_steps - 1, out=at_step)
    rows = np.arange(num_ranks)[:, None]

    def normal(scale: float) -> NDArray[np.float32]:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    busy_share = np.clip(compute[rows, at_step] / end[at_step], 0.0, 1.0)
    util = np.clip(100.0 * busy_share + normal(1.0), 0.0, 100.0)
    power = np.clip(0.85 * spec.power_cap_w * busy_share + normal(10.0), 60.0, spec.power_cap_w)
    temp = 55.0 + 20.0 * busy_share + normal(1.0)
    clock = spec.max_sm_clock_mhz - np.abs(normal(10.0))
    reasons = np.where(rng.random(shape, dtype=np.float32) < 0.02, SW_POWER_CAP, 0)

    extra = extra_compute[rows, at_step]
    throttled = extra > 0
    if throttled.any():
        slowdown = 1.0 + extra / clean_compute[at_step]
        clock = np.where(throttled, spec.max_sm_clock_mhz / slowdown + normal(5.0), clock)
        power = np.where(throttled, spec.power_cap_w - np.abs(normal(2.0)), power)
        temp = np.where(throttled, 88.0 + normal(1.0), temp)
        both = rng.random(shape, dtype=np.float32) < 0.9
        throttle = np.where(both, SW_THERMAL_SLOWDOWN | SW_POWER_CAP, SW_THERMAL_SLOWDOWN)
        reasons = np.where(throttled, throttle, reasons)

    n = num_samples * num_ranks
    mem_total = 85_899_345_920
    rank = np.repeat(np.arange(num_ranks, dtype=np.int64), num_samples)
    return {
        "rank": rank,
        "ts": ts.ravel(),
        "gpu_index": rank % spec.ranks_per_node,
        "util": util.astype(np.float64).ravel(),
        "mem_used_bytes": np.full(n, int(0.75 * mem_total), dtype=np.int64),
        "mem_total_bytes": np.full(n, mem_total, dtype=np.int64),
        "power_w": power.astype(np.float64).ravel(),
        "temp_c": temp.astype(np.float64).ravel(),
        "sm_clock_mhz": clock.astype(np.float64).ravel(),
        "throttle_reasons": reasons.astype(np.int64).ravel(),
    }


def to_frames(job: SynthJob) -> dict[str, pl.DataFrame]:
    """The job as polars frames: steps, collectives, gpu, ranks, jobs (job_id and node added)."""
    import polars as pl

    job_id = pl.lit(job.spec.job_id, dtype=pl.String).alias("job_id")
    nodes = pl.Series("node", job.nodes, dtype=pl.String)

    def frame(columns: Columns, names: tuple[str, ...]) -> pl.DataFrame:
        data = pl.DataFrame({name: columns[name] for name in names if name in columns})
        data = data.with_columns(job_id)
        if "node" in names:
            data = data.with_columns(nodes.gather(data["rank"]))
        return data.select(name for name in names if name in data.columns)

    frames = {"steps": frame(job.steps, STEPS.names)}
    if job.collectives:
        frames["collectives"] = frame(job.collectives, COLLECTIVES.names)
    if job.gpu:
        frames["gpu"] = frame(job.gpu, GPU.names)
    num_ranks = job.spec.num_ranks
    ranks = {
        "rank": np.arange(num_ranks, dtype=np.int64),
        "local_rank": np.arange(num_ranks, dtype=np.int64) % job.spec.ranks_per_node,
    }
    frames["ranks"] = frame(ranks, RANKS.names)
    row = {**job.job, "attributes": json.dumps(job.job["attributes"])}
    frames["jobs"] = pl.DataFrame([row]).select(JOBS.names)
    return frames
