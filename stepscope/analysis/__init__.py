"""Analysis (DESIGN §5): canonical DataFrames in, Findings out. Pure polars and numpy.

`analyze` (stepscope.analysis.pipeline) runs the whole analysis of one job; the modules
beside it are its detectors (stragglers, dataloader, collectives, throughput, telemetry,
causes), its statistics (grid, rank_levels, changepoints, robust, student_t, runs), the
rollups and segments the incremental pass shares with it, and the CI gate's statistics
(regression, metric_tests, baselines, attribution).
"""

from stepscope.analysis.causes import with_causes
from stepscope.analysis.config import AnalysisConfig
from stepscope.analysis.findings import findings_to_frame
from stepscope.analysis.pipeline import (
    NUMERIC_STEP_COLUMNS,
    analyze,
    job_findings,
    rank_findings,
)
from stepscope.analysis.throughput import mfu_per_step

__all__ = [
    "NUMERIC_STEP_COLUMNS",
    "AnalysisConfig",
    "analyze",
    "findings_to_frame",
    "job_findings",
    "mfu_per_step",
    "rank_findings",
    "with_causes",
]
