"""GPU telemetry as evidence: is a slow rank's GPU throttled compared with its peers'?"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import polars as pl
from numpy.typing import NDArray

from stepscope.analysis.config import AnalysisConfig

SLOWDOWN_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
"""NVML clocks-event reasons that slow the GPU down: SW power cap, HW slowdown, SW and HW
thermal slowdown, HW power brake (not idle, application clocks or sync boost)."""

_MAX_PEERS = 64
_MIN_SHARE_ABOVE_PEERS = 0.25


StepWindow = tuple[int, int, int]
"""(rank, first_step, last_step)."""
GpuSource = Callable[[list[int]], pl.DataFrame]
"""Reads the GPU samples of some ranks (a store query, say)."""
GPU_COLUMNS = ("rank", "ts", "sm_clock_mhz", "power_w", "temp_c", "throttle_reasons")
"""What the evidence reads of the samples."""


class GpuEvidence:
    """Telemetry of slow ranks over their slow steps, next to the same time on their peers."""

    def __init__(
        self,
        gpu: pl.DataFrame | pl.LazyFrame | GpuSource,
        times: Callable[[StepWindow], tuple[float, float] | None],
        config: AnalysisConfig,
        *,
        ranks: NDArray[np.int64],
    ) -> None:
        """`gpu` holds or reads GPU samples (read only when asked); `ranks`: sorted ranks."""
        self._gpu = gpu
        self._times = times
        self._config = config
        self._ranks = ranks

    def __call__(self, windows: list[StepWindow]) -> list[dict[str, Any]]:
        """For each window: medians of clock, power, temperature, share of slowed samples."""
        if not windows:
            return []
        peers = self._ranks[:: max(1, self._ranks.size // _MAX_PEERS)].tolist()
        wanted = sorted({*peers, *(w[0] for w in windows)})
        if callable(self._gpu):
            rows = self._gpu(wanted)
        else:
            gpu = self._gpu.lazy()
            columns = [c for c in GPU_COLUMNS if c in gpu.collect_schema()]
            rows = gpu.select(columns).filter(pl.col("rank").is_in(wanted)).collect()
        return [self._one(rows, w) for w in windows]

    def _one(self, rows: pl.DataFrame, window: StepWindow) -> dict[str, Any]:
        rank = window[0]
        times = self._times(window)
        if times is None:
            return {}
        t0, t1 = times
        per_rank = (
            rows.filter(pl.col("ts").is_between(t0, t1))
            .group_by("rank")
            .agg(
                pl.len().alias("samples"),
                *(
                    pl.col(c).median()
                    for c in ("sm_clock_mhz", "power_w", "temp_c")
                    if c in rows.columns
                ),
                *(
                    [((pl.col("throttle_reasons") & SLOWDOWN_REASONS) != 0).mean().alias("slowed")]
                    if "throttle_reasons" in rows.columns
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
