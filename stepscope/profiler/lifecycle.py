"""This process's place in the job's life: when it started, which restart it is, and the
scheduler's times (docs/goodput.md). Read once at init; stdlib only."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Lifecycle:
    """What the `start` event of this process says."""

    started_at: float
    """When the operating system started this process (epoch s); init time if unknown."""
    restart_count: int | None
    """torchrun's TORCHELASTIC_RESTART_COUNT or Slurm's SLURM_RESTART_COUNT (requeues)."""
    submitted_at: float | None
    """When the job was submitted to the scheduler (STEPSCOPE_SUBMITTED_AT), epoch s."""
    scheduled_at: float | None
    """When the scheduler started the job (STEPSCOPE_SCHEDULED_AT, SLURM_JOB_START_TIME)."""


def detect_lifecycle(env: dict[str, str] | None = None) -> Lifecycle:
    """This process's start time, restart count and scheduler times."""
    env = dict(os.environ) if env is None else env
    return Lifecycle(
        started_at=process_start_time() or time.time(),
        restart_count=_first_count(env, "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"),
        submitted_at=_first_epoch(env, "STEPSCOPE_SUBMITTED_AT"),
        scheduled_at=_first_epoch(env, "STEPSCOPE_SCHEDULED_AT", "SLURM_JOB_START_TIME"),
    )


def process_start_time(pid: int | None = None) -> float | None:
    """When the process started (epoch s), from /proc on Linux; None elsewhere."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            stat = f.read()
        with open("/proc/stat") as f:
            boot_s = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        # Field 22 (starttime, clock ticks since boot) counts after the ")" of the command name.
        start_ticks = float(stat[stat.rindex(")") + 2 :].split()[19])
        return boot_s + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _first_count(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        try:
            value = int(env.get(name, ""))
        except ValueError:
            continue
        if value >= 0:
            return value
    return None


def _first_epoch(env: dict[str, str], *names: str) -> float | None:
    for name in names:
        try:
            value = float(env.get(name, ""))
        except ValueError:
            continue
        if math.isfinite(value) and value > 0:
            return value
    return None
