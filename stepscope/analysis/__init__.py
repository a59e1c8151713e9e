"""Analysis (DESIGN §5): canonical DataFrames in, Findings out. Pure polars and numpy.

`analyze` (stepscope.analysis.job) runs the whole analysis of one job, with thresholds from
`config`, over the rollups (`rollups`) that the incremental pass shares with it. Its rooms,
by subject:

- `stragglers/`: ranks slower than their peers (the test, segments of long jobs, evidence);
- `communication/`: collective finish times, slow collectives, who waited for whom;
- `throughput/`: job throughput and MFU, their change points and causes;
- `data/`: data-bound jobs and ranks;
- `hangs/`, `goodput/`, `fleet/`, `captures/`: the server's other answers;
- `regression/`: the CI gate's statistics;
- `stats/` and `frames/`: the statistics and the frames that the detectors share.
"""

from stepscope.analysis.config import AnalysisConfig
from stepscope.analysis.frames.findings import findings_to_frame
from stepscope.analysis.job import (
    NUMERIC_STEP_COLUMNS,
    analyze,
    job_findings,
    rank_findings,
)
from stepscope.analysis.throughput.causes import with_causes
from stepscope.analysis.throughput.findings import mfu_per_step

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
