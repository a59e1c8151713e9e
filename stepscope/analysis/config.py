"""Thresholds of the analysis, in one dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stepscope.analysis.stats.changepoints import ChangePointConfig
from stepscope.schema import Severity


@dataclass(kw_only=True, slots=True)
class AnalysisConfig:
    warmup_steps: int = 20
    """Leading steps of the job ignored (compilation, autotuning, cache warm-up)."""

    window_steps: int = 50
    """Steps of a window: the context a step segment reads of the one before, and the window
    of the dataloader and collective detectors."""

    min_steps: int = 30
    """Steps a rank must be slow for to be a straggler at the test's significance. A slowdown
    larger against the noise is named after fewer steps (down to 10): its statistic must pass
    the threshold times sqrt(min_steps / steps) (stepscope.analysis.stragglers.rank_levels)."""

    min_effect: float = 0.015
    """Smallest slowdown reported: how much slower a rank became than it was, relative to its
    peers' median of the metric it shows in (compute, data or collective time); 1.5%."""

    min_offset: float = 0.02
    """Smallest excess over its peers reported of a rank slow throughout the steps compared
    (hardware is never quite equal), relative to their median of that metric; 2%."""

    distinct_offset: float = 0.25
    """Excess over its peers (relative to their median of the metric) beyond which hardware
    differences are no explanation: a rank slow throughout by this much is tested against the
    noise of its own steps, not against the spread of the ranks' levels (which a job of a few
    ranks cannot tell apart from a straggler); 25%."""

    stage_offset: float = 1.0
    """In a pipeline, whose stages differ by design, the excess over the other stages from
    which a stage slow throughout is named (tested against the noise of its steps): a stage
    twice the median stage holds the whole pipeline back, by design or not; 100%."""

    min_step_share: float = 0.005
    """Smallest straggler reported, relative to the job's step time (a small metric such as
    data_s needs this much of the step to count)."""

    max_p_value: float = 1e-3
    """Chance that a job without stragglers gets one, per step segment: the straggler test's
    significance, Bonferroni-divided over ranks, channels and positions scanned."""

    segment_cells: int = 262_144
    """Rank × steps analysed together: a long job's ranks are compared segment by segment of
    about this many rank-steps (at least 4 windows), so a live job re-analyses one segment."""

    node_share: float = 0.5
    """More than this share of a node's ranks flagged makes one straggler_node finding."""

    warning_impact: float = 0.01
    """Share of the job's step time a straggler costs from which it is a warning (below: info)."""

    critical_impact: float = 0.15
    """Share of the job's step time a straggler costs from which it is critical."""

    warning_gpus: float = 1.0
    """GPU-equivalents a straggler costs (share × ranks) from which it is at least a warning."""

    critical_gpus: float = 32.0
    """GPU-equivalents a straggler costs from which it is critical."""

    cause_steps: int = 25
    """A throughput or MFU change point this close (in steps) to the start (for a drop) or
    the end (for a gain) of a rank-level finding names that finding as its cause."""

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
        if self.min_steps < 2 or self.cause_steps < 0:
            raise ValueError("min_steps must be >= 2 and cause_steps >= 0")
        for name in ("node_share", "throttle_share", "clock_drop", "busbw_drop", "max_p_value"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1)")
        if not (0 < self.min_effect < 1 and 0 < self.min_offset < 1):
            raise ValueError("min_effect and min_offset must be in (0, 1)")
        if not self.min_offset < self.distinct_offset <= self.stage_offset:
            raise ValueError("need min_offset < distinct_offset <= stage_offset")
        if not 0 <= self.min_step_share < 1:
            raise ValueError("min_step_share must be in [0, 1)")
        if not 0 < self.warning_impact <= self.critical_impact:
            raise ValueError("need 0 < warning_impact <= critical_impact")
        if not 0 < self.warning_gpus <= self.critical_gpus:
            raise ValueError("need 0 < warning_gpus <= critical_gpus")
        if not 0 < self.data_share <= self.critical_data_share:
            raise ValueError("need 0 < data_share <= critical_data_share")

    def severity_of(self, step_share: float, gpus: float) -> Severity:
        """info, warning or critical for what a finding costs the job: a share of its step
        time, and that share times its ranks (GPU-equivalents)."""
        if step_share >= self.critical_impact or gpus >= self.critical_gpus:
            return "critical"
        if step_share >= self.warning_impact or gpus >= self.warning_gpus:
            return "warning"
        return "info"
