"""The query layer (DESIGN §6): typed questions about stored jobs, answered from rollups.

The REST API, the dashboard and `stepscope check` call these in-process. Each takes an
engine and a job id and returns frozen dataclasses of numpy arrays or plain values; the
SQL lives in `stepscope.store.reads`, the statistics here. An unknown job raises
JobNotFound; a bad argument raises ValueError naming it and its allowed values.
"""

from stepscope.query.collectives import CollectiveStats, OpSeries, SizeStats, collective_stats
from stepscope.query.common import JobNotFound
from stepscope.query.compare import Comparison, ComponentDifference, Difference, compare
from stepscope.query.exports import FORMATS as EXPORT_FORMATS
from stepscope.query.exports import MEDIA_TYPES as EXPORT_MEDIA_TYPES
from stepscope.query.exports import TABLES as EXPORT_TABLES
from stepscope.query.exports import export
from stepscope.query.gpu import GpuSeries, gpu_series
from stepscope.query.hangs import open_hang, open_hangs
from stepscope.query.heatmaps import METRICS as HEATMAP_METRICS
from stepscope.query.heatmaps import STATS as HEATMAP_STATS
from stepscope.query.heatmaps import Heatmap, decode_values, heatmap
from stepscope.query.jobs import SORT_KEYS as JOB_SORT_KEYS
from stepscope.query.jobs import STATUSES as JOB_STATUSES
from stepscope.query.jobs import JobFilters, JobRow, JobsPage, list_jobs
from stepscope.query.mesh import FIXED_GROUPINGS, Mesh, job_mesh
from stepscope.query.ranks import RankGroups, RankTable, rank_groups, rank_table
from stepscope.query.series import AGGREGATES as SERIES_AGGREGATES
from stepscope.query.series import METRICS as SERIES_METRICS
from stepscope.query.series import Band, Series, step_band, step_series
from stepscope.query.summary import (
    JobSummary,
    StoredFinding,
    events,
    findings,
    job_summary,
    metric_points,
)

__all__ = [
    "EXPORT_FORMATS",
    "EXPORT_MEDIA_TYPES",
    "EXPORT_TABLES",
    "FIXED_GROUPINGS",
    "HEATMAP_METRICS",
    "HEATMAP_STATS",
    "JOB_SORT_KEYS",
    "JOB_STATUSES",
    "SERIES_AGGREGATES",
    "SERIES_METRICS",
    "Band",
    "CollectiveStats",
    "Comparison",
    "ComponentDifference",
    "Difference",
    "GpuSeries",
    "Heatmap",
    "JobFilters",
    "JobNotFound",
    "JobRow",
    "JobSummary",
    "JobsPage",
    "Mesh",
    "OpSeries",
    "RankGroups",
    "RankTable",
    "Series",
    "SizeStats",
    "StoredFinding",
    "collective_stats",
    "compare",
    "decode_values",
    "events",
    "export",
    "findings",
    "gpu_series",
    "heatmap",
    "job_mesh",
    "job_summary",
    "metric_points",
    "list_jobs",
    "open_hang",
    "open_hangs",
    "rank_groups",
    "rank_table",
    "step_band",
    "step_series",
]
