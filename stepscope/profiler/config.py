"""Profiler configuration (one Config: arguments, then STEPSCOPE_* variables) and run detection."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Literal

from stepscope.profiler.scheduler import scheduler_view

ENV_PREFIX = "STEPSCOPE_"

FlopsSetting = float | Literal["auto"] | None
CommTiming = Literal["step", "bucket", "off"]
COMM_TIMINGS = ("step", "bucket", "off")


@dataclass(kw_only=True, slots=True)
class Config:
    """Everything the in-process profiler can be told; each field also reads STEPSCOPE_<FIELD>."""

    url: str | None = None
    """Collector base URL, e.g. http://collector:8000. None disables the profiler."""

    relay_url: str | None = None
    """`stepscope run`'s node relay, which sends the batches of the node's ranks to the collector
    in one request (set by `stepscope run`). Each rank then flushes in its node's time slot."""

    token: str | None = None
    """Bearer token with the `ingest` scope (optional on a loopback collector)."""

    job_id: str | None = None
    """Job identifier; detected from torchrun/Slurm when not given."""

    name: str | None = None
    """Human-readable job name."""

    benchmark_key: str | None = None
    """What makes two jobs comparable (model, config, world size, hardware)."""

    attributes: dict[str, Any] = field(default_factory=dict)
    """Free-form job attributes (git sha, parallelism...); STEPSCOPE_ATTRIBUTES is JSON."""

    disabled: bool = False
    """Turn the profiler into a no-op."""

    tokens_per_step: int | None = None
    """Tokens this rank processes per step, when prof.record() does not say."""

    samples_per_step: int | None = None
    """Samples this rank processes per step, when prof.record() does not say."""

    flops_per_step: FlopsSetting = None
    """Model FLOPs this rank executes per step, or "auto" to count them once on the first step."""

    peak_flops: float | None = None
    """Peak FLOP/s of one device; looked up from the device name when not given."""

    flush_interval_s: float | None = None
    """How often the shipper sends buffered records, in seconds. None: 2 s, lengthened on
    jobs of more than 512 ranks (world_size / 256 s, at most 30 s) so that the collector gets
    about 256 batches/s from a job of any size."""

    gpu_interval_s: float = 1.0
    """GPU telemetry sampling interval, in seconds."""

    max_buffer_rows: int = 100_000
    """Records (of each kind) held in memory before new ones are dropped and counted."""

    max_batch_rows: int = 5_000
    """Most records of one kind in one wire batch."""

    max_pending_batches: int = 16
    """Unacknowledged batches held in memory; beyond that they spill (or are dropped)."""

    spill_dir: str | None = None
    """Directory for batches that cannot be sent while the collector is down (None: drop them)."""

    spill_max_bytes: int = 256 * 1024 * 1024
    """Largest size of the spill file, in bytes."""

    http_timeout_s: float = 10.0
    """Timeout of one POST to the collector, in seconds."""

    close_timeout_s: float = 10.0
    """How long close() waits for the last records to be acknowledged, in seconds."""

    backoff_max_s: float = 30.0
    """Longest pause between retries while the collector is unreachable, in seconds."""

    patch_collectives: bool = True
    """Record every collective this process issues, per process group, while the profiler is
    active (the collective tap: torch.distributed, FSDP, tensor and pipeline parallelism,
    compiled graphs); DDP's own all-reduces are timed by comm_timing."""

    comm_timing: CommTiming = "step"
    """How watched DDP models' gradient all-reduces are timed. "step": twice per step, with DDP
    untouched (comm_wait_s, bytes, bucket count; about 10 us a step). "bucket": a comm hook
    stamps every bucket, adding comm_s (time in flight behind backward) and per-bucket busy
    time, for a Python call and a future callback per bucket (35-50 us each on CPU) and
    one more pass over the gradients. "off": not timed."""

    hang_watchdog: bool = True
    """Run the progress watchdog: heartbeats, and hang reports with the training thread's
    stack when the rank makes no progress for hang_after_s (POST /v1/hangs)."""

    hang_after_s: float | None = None
    """Seconds without progress (a step ending, a section or phase changing, a collective
    completing) after which the rank reports a hang. None: adaptive, 5 x the rolling p99 of
    the step time, at least 5 s. Whatever it is, 600 s during the first 5 steps and inside
    declared phases (prof.phase(name))."""

    heartbeat_s: float = 2.0
    """How often the watchdog reports (a heartbeat, or the hang while it lasts), in seconds."""

    hang_dump_dir: str | None = None
    """Directory of the per-rank files faulthandler writes the stacks to when the training
    thread holds the GIL and the watchdog cannot run; `stepscope run` sets it and ships
    them. None: no such files."""

    otlp_endpoint: str | None = None
    """Also export per-step metrics (step time, data and comm-wait shares, tokens/s, MFU, GPU
    telemetry) through the OpenTelemetry SDK to this OTLP/HTTP metrics URL, e.g.
    http://otel-collector:4318/v1/metrics. Needs `pip install 'stepscope[otel]'`. None: off."""

    capture: bool = True
    """Record torch.profiler for a few steps when the collector asks (a deep capture of a
    straggler or hung rank, or of a user's choice; #21) and upload the trace. Off: such
    requests are ignored."""

    capture_max_steps: int = 20
    """Most steps one deep capture records, whatever the collector asks."""

    capture_max_s: float = 120.0
    """Longest a deep capture records, in seconds; it stops after the step that passes it."""

    capture_with_stack: bool = True
    """Record Python stacks (with_stack=True): the trace names the Python functions."""

    capture_dir: str | None = None
    """Directory for the trace while it is exported and compressed (None: the temp dir)."""

    def __post_init__(self) -> None:
        for name in (
            "flush_interval_s",
            "gpu_interval_s",
            "http_timeout_s",
            "backoff_max_s",
            "hang_after_s",
            "heartbeat_s",
            "capture_max_s",
        ):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.close_timeout_s < 0:
            raise ValueError("close_timeout_s must be >= 0")
        for name in (
            "max_buffer_rows",
            "max_batch_rows",
            "max_pending_batches",
            "capture_max_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("url", "relay_url"):
            value = getattr(self, name)
            if value and not is_http_url(value):
                raise ValueError(f"{name} must be an http:// or https:// URL, got {value!r}")
        if self.comm_timing not in COMM_TIMINGS:
            raise ValueError(f"comm_timing must be one of {', '.join(COMM_TIMINGS)}")
        if isinstance(self.flops_per_step, str) and self.flops_per_step != "auto":
            raise ValueError('flops_per_step must be a number, "auto" or None')
        for name in ("tokens_per_step", "samples_per_step", "flops_per_step", "peak_flops"):
            value = getattr(self, name)
            if isinstance(value, int | float) and value < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def enabled(self) -> bool:
        return not self.disabled and bool(self.url)


def default_flush_interval_s(world_size: int) -> float:
    """2 s, or world_size / 256 s on large jobs (at most 30 s)."""
    return min(30.0, max(2.0, world_size / 256))


def parse_bool(text: str) -> bool:
    """Whether an environment variable's text says yes (1, true, yes, on)."""
    return text.strip().lower() in ("1", "true", "yes", "on")


def _parse_env(name: str, text: str) -> Any:
    """Parse one STEPSCOPE_* value for the Config field `name`."""
    if name == "attributes":
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"{ENV_PREFIX}ATTRIBUTES must be a JSON object, got {text!r}")
        return value
    if name == "flops_per_step":
        return "auto" if text.strip().lower() == "auto" else float(text)
    default = Config.__dataclass_fields__[name].default
    if isinstance(default, bool):
        return parse_bool(text)
    if name in ("tokens_per_step", "samples_per_step") or isinstance(default, int):
        return int(text)
    if name in ("peak_flops", "flush_interval_s", "hang_after_s") or isinstance(default, float):
        return float(text)
    return text


def build_config(**overrides: Any) -> Config:
    """A Config: explicit values (unless None) over STEPSCOPE_* variables over defaults."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        text = os.environ.get(ENV_PREFIX + f.name.upper())
        if text is not None and text != "":
            values[f.name] = _parse_env(f.name, text)
    for key, value in overrides.items():
        if key not in Config.__dataclass_fields__:
            raise TypeError(f"unknown stepscope option {key!r}")
        if value is not None:
            values[key] = value
    return Config(**values)


@dataclass(kw_only=True, slots=True)
class RunEnv:
    """Where this process sits in the job, detected from torchrun / Slurm variables."""

    rank: int
    local_rank: int
    world_size: int
    node_rank: int | None
    node: str
    pid: int
    job_id: str | None
    """Job id the launcher gives every rank alike (TORCHELASTIC_RUN_ID, SLURM_JOB_ID, a
    Kubernetes job label)."""
    job_attributes: dict[str, Any] = field(default_factory=dict)
    """What the scheduler says of the job (Slurm job, array task, node list, requeue count;
    Kubernetes namespace and pod labels)."""
    rank_attributes: dict[str, Any] = field(default_factory=dict)
    """What the scheduler says of this rank (pod, host and node names)."""


def _first_int(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        text = env.get(name, "")
        if text:
            try:
                return int(text)
            except ValueError:
                continue
    return None


def detect_env(env: dict[str, str] | None = None) -> RunEnv:
    """Rank, world size, node and launcher job id of this process."""
    env = dict(os.environ) if env is None else env
    rank = _first_int(env, "RANK", "SLURM_PROCID") or 0
    view = scheduler_view(env, rank=rank)
    hostname = socket.gethostname()
    job_id: str | None = None
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        job_id = run_id
    elif env.get("SLURM_JOB_ID"):
        job_id = "slurm-" + env["SLURM_JOB_ID"]
        if env.get("SLURM_STEP_ID"):
            job_id += "." + env["SLURM_STEP_ID"]
    elif view.job_name:
        job_id = "k8s-" + view.job_name.replace("/", "-")
    node = view.node or hostname
    return RunEnv(
        rank=rank,
        local_rank=_first_int(env, "LOCAL_RANK", "SLURM_LOCALID") or 0,
        world_size=_first_int(env, "WORLD_SIZE", "SLURM_NTASKS") or 1,
        node_rank=_first_int(env, "GROUP_RANK", "SLURM_NODEID"),
        node=node,
        pid=os.getpid(),
        job_id=job_id,
        job_attributes=view.job_attributes,
        # The physical node is `node`; the machine name the process sees is kept beside it.
        rank_attributes={**view.rank_attributes, "host.name": hostname},
    )


def is_http_url(url: str) -> bool:
    """An http:// or https:// URL with a host (and a numeric port, if any)."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises ValueError when the port is not a number)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)
