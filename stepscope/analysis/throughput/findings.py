"""Job-level throughput and MFU per step, and the findings about them (DESIGN §5).

In synchronous training every rank finishes a step together, so the job's step time is the
slowest rank's `step_s`; work (tokens, samples, FLOPs) adds up over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl

from stepscope.analysis.rollups import mfu, step_rollup
from stepscope.analysis.stats.changepoints import (
    ChangePoint,
    ChangePointConfig,
    detect_change_points,
)
from stepscope.schema import Finding, FindingKind, Severity

_WORK_COLUMNS = ("tokens", "samples", "flops")

CRITICAL_DROP = 0.10
"""A drop of at least this relative size is critical; smaller significant drops warn."""


def job_series(steps: pl.DataFrame) -> pl.DataFrame:
    """Per step: ranks reporting, job step_s (max over ranks), summed work, and rates.

    Columns: step, num_ranks, step_s, tokens, samples, flops, num_flops_ranks, tokens_per_s,
    samples_per_s, steps_per_s. A work sum and its rate are null in a step where no rank
    reported that work.
    """
    return rollup_series(step_rollup(steps))


def rollup_series(rollup: pl.DataFrame) -> pl.DataFrame:
    """The job series (see job_series) of a step rollup (stepscope.analysis.rollups)."""
    return rollup.select(
        "step",
        "num_ranks",
        pl.col("step_s_max").alias("step_s"),
        *_WORK_COLUMNS,
        "num_flops_ranks",
        (pl.col("tokens") / pl.col("step_s_max")).alias("tokens_per_s"),
        (pl.col("samples") / pl.col("step_s_max")).alias("samples_per_s"),
        (1.0 / pl.col("step_s_max")).alias("steps_per_s"),
    )


def mfu_per_step(
    steps: pl.DataFrame, peak_flops: float | None, world_size: int | None = None
) -> pl.DataFrame:
    """Per step: mfu = summed rank FLOPs / job step_s / (peak_flops × ranks).

    Ranks is `world_size` when given, else the ranks that reported FLOPs in that step (so a
    step some ranks have not reported yet is not under-counted). mfu is null without a
    peak or without FLOPs: there is no fallback peak.
    """
    rollup = step_rollup(steps)
    return rollup.select("step", mfu(rollup, peak_flops, world_size))


def throughput_findings(
    steps: pl.DataFrame,
    *,
    job: Mapping[str, Any] | None,
    config: ChangePointConfig,
    critical_drop: float = CRITICAL_DROP,
    mfu_low_below: float | None = None,
) -> list[Finding]:
    """Throughput and MFU findings of one job: drops, gains, unknown peak, low MFU.

    Throughput is tokens/s when the steps carry tokens, else steps/s; only steps reported by
    at least the median number of ranks count (a step still arriving is not a drop).
    `mfu_low_below` (a fraction, e.g. 0.3) enables `mfu_low` on the post-warm-up median.
    """
    if steps.is_empty():
        return []
    job = {**(job or {}), "job_id": _job_id(steps, job or {})}
    return series_findings(
        job_series(steps),
        job=job,
        config=config,
        critical_drop=critical_drop,
        mfu_low_below=mfu_low_below,
    )


def series_findings(
    series: pl.DataFrame,
    *,
    job: Mapping[str, Any],
    config: ChangePointConfig,
    critical_drop: float = CRITICAL_DROP,
    mfu_low_below: float | None = None,
) -> list[Finding]:
    """throughput_findings of a job series (job_series, rollup_series); job has a job_id."""
    if series.is_empty():
        return []
    job_id = str(job["job_id"])
    series = series.filter(pl.col("num_ranks") >= pl.col("num_ranks").median())

    findings: list[Finding] = []
    metric = "tokens_per_s" if series["tokens"].null_count() < series.height else "steps_per_s"
    findings += _shift_findings(job_id, series, metric, config, critical_drop)

    if series["flops"].null_count() == series.height:
        return findings
    peak_flops = job.get("peak_flops")
    if peak_flops is None or not peak_flops > 0:
        findings.append(_peak_unknown(job_id, job, series, reason="no peak_flops for the device"))
        return findings
    per_step = series.select(
        "step", mfu(series.rename({"step_s": "step_s_max"}), peak_flops, job.get("world_size"))
    )
    findings += _shift_findings(job_id, per_step, "mfu", config, critical_drop)
    settled = per_step["mfu"].slice(config.warmup_steps).drop_nulls()
    median_mfu = settled.median() if settled.len() else None
    if isinstance(median_mfu, float) and median_mfu > 1.0:
        findings.append(
            _peak_unknown(
                job_id, job, series, reason="MFU above 100%: peak_flops is too low for the device"
            )
        )
    if mfu_low_below is not None and isinstance(median_mfu, float) and median_mfu < mfu_low_below:
        findings.append(
            Finding(
                job_id=job_id,
                kind="mfu_low",
                severity="warning",
                first_step=int(series["step"][0]),
                last_step=int(series["step"][-1]),
                metric="mfu",
                expected=mfu_low_below,
                observed=median_mfu,
                effect=median_mfu / mfu_low_below - 1.0,
                evidence={"peak_flops": float(peak_flops), "steps": settled.len()},
            )
        )
    return findings


def _job_id(steps: pl.DataFrame, job: Mapping[str, Any]) -> str:
    """The job's id: from a job_id column (one value throughout), else from `job`."""
    if "job_id" in steps.columns:
        job_ids = steps["job_id"]
        first = job_ids[0]
        # A comparison with the first id, not unique(): no hashing of millions of strings.
        if (job_ids != first).any():
            raise ValueError("steps hold several job_ids: analyse one job at a time")
        if first is not None:
            return str(first)
    if job.get("job_id"):
        return str(job["job_id"])
    raise ValueError("no job_id: give steps a job_id column or pass job={'job_id': ...}")


def _shift_findings(
    job_id: str,
    series: pl.DataFrame,
    metric: str,
    config: ChangePointConfig,
    critical_drop: float,
) -> list[Finding]:
    """A throughput_drop or throughput_gain finding per level shift of `metric`."""
    present = series.select("step", metric).drop_nulls()
    values = present[metric].to_numpy().astype(np.float64)
    step_numbers = present["step"].to_numpy()
    changes = detect_change_points(values, step_numbers, config=config)
    last_steps = [c.step - 1 for c in changes[1:]]
    if changes:
        last_steps.append(int(step_numbers[-1]))
    return [
        _shift_finding(job_id, metric, change, last_step, critical_drop)
        for change, last_step in zip(changes, last_steps, strict=True)
    ]


def _shift_finding(
    job_id: str, metric: str, change: ChangePoint, last_step: int, critical_drop: float
) -> Finding:
    kind: FindingKind
    severity: Severity
    if change.effect < 0:
        kind = "throughput_drop"
        severity = "critical" if -change.effect >= critical_drop else "warning"
    else:
        kind, severity = "throughput_gain", "info"
    return Finding(
        job_id=job_id,
        kind=kind,
        severity=severity,
        first_step=change.step,
        last_step=last_step,
        metric=metric,
        expected=change.before,
        observed=change.after,
        effect=change.effect,
        evidence={
            "p_value": change.p_value,
            "statistic": change.statistic,
            "before_steps": change.before_steps,
            "after_steps": change.after_steps,
        },
    )


def _peak_unknown(
    job_id: str, job: Mapping[str, Any], series: pl.DataFrame, *, reason: str
) -> Finding:
    peak_flops = job.get("peak_flops")
    return Finding(
        job_id=job_id,
        kind="peak_unknown",
        severity="warning",
        first_step=int(series["step"][0]),
        last_step=int(series["step"][-1]),
        metric="mfu",
        evidence={
            "reason": reason,
            "device_name": job.get("device_name"),
            "peak_flops": float(peak_flops)
            if isinstance(peak_flops, int | float) and math.isfinite(peak_flops)
            else None,
            "hint": "pass peak_flops (FLOP/s per device) to stepscope.init() to get MFU",
        },
    )
