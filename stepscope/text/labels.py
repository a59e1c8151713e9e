"""What finding kinds, causes, time components and DeviceMesh dimensions are called: a short
label for a line or a chart, a long one for a sentence or a title."""

from __future__ import annotations

from typing import NamedTuple, cast

from stepscope.schema import Cause, Component, FindingKind, GoodputCategory, HangClass


class Label(NamedTuple):
    short: str
    """For a terminal line, a legend or an axis: "straggler", "comm wait"."""
    long: str
    """For a title or a sentence: "Straggler rank", "waiting on collectives"."""


KINDS: dict[FindingKind, Label] = {
    "straggler_rank": Label("straggler", "Straggler rank"),
    "straggler_node": Label("slow node", "Slow node"),
    "dataloader_stall": Label("dataloader stall", "Dataloader stall"),
    "slow_collective": Label("slow collective", "Slow collective"),
    "gpu_throttling": Label("GPU throttling", "GPU throttling"),
    "throughput_drop": Label("throughput drop", "Throughput drop"),
    "throughput_gain": Label("throughput gain", "Throughput gain"),
    "mfu_low": Label("low MFU", "Low MFU"),
    "peak_unknown": Label("peak FLOP/s unknown", "Peak FLOP/s unknown"),
    "hang": Label("hang", "Hang"),
}
HANG_CLASSES: dict[HangClass, Label] = {
    "never_entered": Label("never entered", "never entered the collective its peers wait in"),
    "mismatched": Label("mismatched", "called a different collective at the same point"),
    "not_completing": Label(
        "not completing", "every rank entered; the collective does not complete"
    ),
    "silent": Label("silent", "stopped reporting (frozen, GIL held or dead)"),
}
CAUSES: dict[Cause, Label] = {
    "data": Label("data", "waiting for data (the input pipeline)"),
    "compute": Label("compute", "slower compute"),
    "communication": Label("communication", "slower collectives (network or NVLink)"),
    "gpu_throttling": Label("gpu_throttling", "a throttled GPU (clocks held down)"),
    "host": Label("host", "the host (CPU, memory or OS)"),
    "unknown": Label("unknown", "not determined"),
}
COMPONENTS: dict[Component, Label] = {
    "step_s": Label("step", "step time"),
    "data_s": Label("data", "data loading"),
    "compute_s": Label("compute", "compute"),
    "comm_wait_s": Label("comm wait", "waiting on collectives"),
    "collective_finish_s": Label("comm", "time to finish collectives"),
}
GOODPUT_CATEGORIES: dict[GoodputCategory, Label] = {
    "productive": Label("productive", "productive training"),
    "startup": Label("startup", "start-up and initialisation"),
    "compile": Label("compile", "compilation and warm-up"),
    "checkpoint_save": Label("ckpt save", "saving checkpoints"),
    "checkpoint_load": Label("ckpt load", "loading checkpoints"),
    "eval": Label("eval", "evaluation"),
    "other_phase": Label("other phase", "other declared phases"),
    "data": Label("data", "waiting for data"),
    "exposed_comm": Label("exposed comm", "collective transfers not overlapped"),
    "straggler_wait": Label("straggler wait", "waiting for slower ranks"),
    "hang": Label("hang", "hung"),
    "restart_downtime": Label("restart", "down between restarts"),
    "lost_progress": Label("lost progress", "steps run again after a restart"),
    "unaccounted": Label("unaccounted", "unaccounted"),
}
"""Where a job's GPU-time went (docs/goodput.md)."""
MESH_DIMS: dict[str, Label] = {
    "pp": Label("stage", "pipeline stage"),
    "tp": Label("tp", "tensor-parallel rank"),
    "dp": Label("dp", "data-parallel rank"),
    "dp_shard": Label("dp shard", "data-parallel shard"),
    "dp_replicate": Label("dp replica", "data-parallel replica"),
    "cp": Label("cp", "context-parallel rank"),
    "ep": Label("ep", "expert-parallel rank"),
}
"""The usual DeviceMesh dimension names (torchtitan's); a coordinate is "stage 1", "tp 0"."""
METRICS: dict[str, Label] = {
    "tokens_per_s": Label("tokens/s", "tokens per second"),
    "samples_per_s": Label("samples/s", "samples per second"),
    "steps_per_s": Label("steps/s", "steps per second"),
    "mfu": Label("MFU", "model FLOPs utilisation"),
    "step_s": Label("step time", "step time"),
}
"""The job-level metrics a throughput change is measured in."""
THROTTLE_REASONS = {
    0x1: "GPU idle",
    0x2: "applications clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
"""NVML clocks-event reasons by bit."""


def kind(name: str, *, long: bool = False) -> str:
    """A finding kind's label; an unknown name (from an older or newer server) in words."""
    label = KINDS.get(cast(FindingKind, name))
    if label is None:
        words = name.replace("_", " ")
        return words.capitalize() if long else words
    return label.long if long else label.short


def cause(name: str, *, long: bool = False, on_gpu: bool = False) -> str:
    """A cause's label (its name when unknown); the long one of compute says "on its GPU"
    with `on_gpu` (the rank's GPU was measured), else not where it ran."""
    label = CAUSES.get(cast(Cause, name))
    if label is None:
        return name
    if long and on_gpu and name == "compute":
        return f"{label.long} on its GPU"
    return label.long if long else label.short


def component(name: str, *, long: bool = False, default: str | None = None) -> str:
    """A time component's label: `default` (else the name itself) when it is not one."""
    label = COMPONENTS.get(cast(Component, name))
    if label is None:
        return name if default is None else default
    return label.long if long else label.short


def mesh_dim(name: str, *, long: bool = False) -> str:
    """A mesh dimension's label: "stage" for pp, "tp"; an unknown one (the mesh's own name)
    with its underscores as spaces."""
    label = MESH_DIMS.get(name)
    if label is None:
        return name.replace("_", " ")
    return label.long if long else label.short


def mesh_coord(dim: str, coord: str | int | None) -> str:
    """A coordinate of a mesh dimension: "stage 1", "tp 0", "tp ?" when not known."""
    return f"{mesh_dim(dim)} {'?' if coord is None else coord}"


def throttle_reasons(mask: int) -> list[str]:
    """Names of the NVML clocks-event reasons set in `mask`."""
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


def hang_class(name: str, *, long: bool = False) -> str:
    """A hang class's label (its name in words when unknown)."""
    label = HANG_CLASSES.get(cast(HangClass, name))
    if label is None:
        return name.replace("_", " ")
    return label.long if long else label.short


def goodput_category(name: str, *, long: bool = False) -> str:
    """A goodput category's label; an unknown name in words."""
    label = GOODPUT_CATEGORIES.get(cast(GoodputCategory, name))
    if label is None:
        return name.replace("_", " ")
    return label.long if long else label.short


def metric(name: str, *, long: bool = False) -> str:
    """A job-level metric's label: "tokens/s", "MFU"; an unknown name in words."""
    label = METRICS.get(name)
    if label is None:
        return name.replace("_", " ")
    return label.long if long else label.short
