"""Thresholds of the analysis, in one dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stepscope.analysis.changepoints import ChangePointConfig
from stepscope.schema import Severity


@dataclass(kw_only=True, slots=True)
class AnalysisConfig:
    warmup_steps: int = 20
    """Leading steps of the job ignored (compilation, autotuning, cache warm-up)."""

    window_steps: int = 50
    """Steps in the sliding window a rank must be persistently slow in."""

    persistence: float = 0.6
    """Share of the window's steps a rank must be slower in before it is a straggler."""

    min_effect: float = 0.03
    """Smallest slowdown reported, relative to the job's step time (0.03 = 3%)."""

    noise_floor_sigmas: float = 0.7
    """A step counts as slow only above this many robust noise sigmas of its metric."""

    segment_cells: int = 262_144
    """Rank × steps analysed together: a long job's ranks are compared segment by segment of
    about this many rank-steps (at least 4 windows), so a live job re-analyses one segment."""

    node_share: float = 0.5
    """More than this share of a node's ranks flagged makes one straggler_node finding."""

    warning_effect: float = 0.05
    """Effect from which a slowdown is a warning (below: info)."""

    critical_effect: float = 0.25
    """Effect from which a slowdown is critical."""

    throttle_share: float = 0.5
    """Share of a rank's GPU samples with a thermal/power slowdown reason that means throttled."""

    clock_drop: float = 0.05
    """SM clock this much below the peers' median means throttled."""

    data_share: float = 0.10
    """Share of the step spent waiting for data from which the job (or a rank) is data-bound."""

    critical_data_share: float = 0.25
    """Data share from which a dataloader stall is critical."""

    busbw_drop: float = 0.3
    """Collective busbw this much below the job's norm (or the expectation) is slow."""

    expected_busbw_bps: Mapping[str, float] | None = None
    """Expected bus bandwidth per collective op (e.g. {"all_reduce": 180e9}); None: job's own."""

    mfu_low_below: float | None = None
    """MFU (fraction) below which the job gets an mfu_low finding; None: off."""

    change_points: ChangePointConfig = field(default_factory=ChangePointConfig)
    """Change-point detection of job throughput and MFU."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if self.window_steps < 2:
            raise ValueError("window_steps must be >= 2")
        if self.segment_cells < 1:
            raise ValueError("segment_cells must be >= 1")
        for name in ("persistence", "node_share", "throttle_share", "clock_drop", "busbw_drop"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1)")
        if self.min_effect <= 0 or self.noise_floor_sigmas < 0:
            raise ValueError("min_effect must be > 0 and noise_floor_sigmas >= 0")
        if not self.min_effect <= self.warning_effect <= self.critical_effect:
            raise ValueError("need min_effect <= warning_effect <= critical_effect")
        if not 0 < self.data_share <= self.critical_data_share:
            raise ValueError("need 0 < data_share <= critical_data_share")

    @property
    def window_min_slow(self) -> int:
        """Slow steps a window needs to confirm a straggler."""
        return max(1, round(self.persistence * self.window_steps))

    def severity_of(self, effect: float) -> Severity:
        """info, warning or critical for a relative slowdown."""
        if effect >= self.critical_effect:
            return "critical"
        return "warning" if effect >= self.warning_effect else "info"
