"""The gate's jobs from canonical steps files (--candidate-steps, --baseline-steps).

A file gives the same JobData (stepscope.analysis.regression) as a stored job
(stepscope.client): its steps are rolled up by the same analysis code.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from stepscope.analysis.regression import JobData, job_from_steps


class StepsFileError(Exception):
    """A steps file that is missing, unreadable or not canonical steps; said for a user."""


def read_steps_files(paths: Sequence[Path], *, peak_flops: float | None = None) -> list[JobData]:
    """One JobData per job found in these canonical steps files (parquet or CSV)."""
    jobs = []
    for path in paths:
        if not path.is_file():
            raise StepsFileError(f"no such file: {path}")
        try:
            steps = pl.read_csv(path) if path.suffix == ".csv" else pl.read_parquet(path)
        except (OSError, pl.exceptions.PolarsError) as exc:
            raise StepsFileError(f"cannot read {path}: {exc}") from None
        missing = [c for c in ("rank", "step", "step_s", "data_s") if c not in steps.columns]
        if missing:
            raise StepsFileError(f"{path} has no {', '.join(missing)} column (canonical steps)")
        groups = (
            steps.partition_by("job_id", maintain_order=True)
            if "job_id" in steps.columns
            else [steps]
        )
        for part in groups:
            job_id = str(part["job_id"][0]) if "job_id" in part.columns else path.stem
            try:
                jobs.append(job_from_steps(part, job_id=job_id, peak_flops=peak_flops))
            except (ValueError, pl.exceptions.PolarsError) as exc:
                raise StepsFileError(f"cannot summarise {path}: {exc}") from None
    return jobs
