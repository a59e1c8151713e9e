"""GPU telemetry as evidence: is a slow rank's GPU throttled compared with its peers'?"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from stepscope.analysis.config import AnalysisConfig

SLOWDOWN_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
"""NVML clocks-event reasons that slow the GPU down: SW power cap, HW slowdown, SW and HW
thermal slowdown, HW power brake (not idle, application clocks or sync boost)."""

_MAX_PEERS = 64
_MIN_SHARE_ABOVE_PEERS = 0.25


class GpuEvidence:
    """Telemetry of one rank over a range of steps, next to the same time on its peers."""

    def __init__(self, gpu: pl.DataFrame, steps: pl.DataFrame, config: AnalysisConfig) -> None:
        self._gpu = gpu
        self._steps = steps
        self._config = config
        ranks = np.sort(gpu["rank"].unique().to_numpy())
        stride = max(1, ranks.size // _MAX_PEERS)
        self._peers = ranks[::stride].tolist()

    def __call__(self, rank: int, first_step: int, last_step: int) -> dict[str, Any]:
        """Medians of clock, power and temperature, and the share of samples slowed down."""
        window = self._steps.filter(
            (pl.col("rank") == rank) & pl.col("step").is_between(first_step, last_step)
        ).select(
            pl.col("ts").min().alias("t0"), (pl.col("ts") + pl.col("step_s")).max().alias("t1")
        )
        t0, t1 = window.row(0)
        if t0 is None:
            return {}
        per_rank = (
            self._gpu.filter(
                pl.col("ts").is_between(t0, t1) & pl.col("rank").is_in([rank, *self._peers])
            )
            .group_by("rank")
            .agg(
                pl.len().alias("samples"),
                *(
                    pl.col(c).median()
                    for c in ("sm_clock_mhz", "power_w", "temp_c")
                    if c in self._gpu.columns
                ),
                *(
                    [((pl.col("throttle_reasons") & SLOWDOWN_REASONS) != 0).mean().alias("slowed")]
                    if "throttle_reasons" in self._gpu.columns
                    else []
                ),
            )
        )
        mine = per_rank.filter(pl.col("rank") == rank)
        peers = per_rank.filter(pl.col("rank") != rank)
        if mine.is_empty() or peers.is_empty():
            return {}
        evidence: dict[str, Any] = {"samples": int(mine["samples"][0])}
        throttled = False
        for column in ("sm_clock_mhz", "power_w", "temp_c", "slowed"):
            if column not in per_rank.columns:
                continue
            value, peer = mine[column][0], peers[column].median()
            if value is None or not isinstance(peer, float):
                continue
            name = "slowdown_share" if column == "slowed" else column
            evidence[name] = {"rank": float(value), "peers": peer}
            if column == "sm_clock_mhz" and value <= (1.0 - self._config.clock_drop) * peer:
                throttled = True
            if (
                column == "slowed"
                and value >= self._config.throttle_share
                and value - peer >= _MIN_SHARE_ABOVE_PEERS
            ):
                throttled = True
        evidence["throttled"] = throttled
        return evidence
