"""Canonical records files: the gate's jobs from steps files (--candidate-steps,
--baseline-steps), and the collectives of `analyze --collectives`.

A steps file gives the same JobData (stepscope.analysis.regression.gate) as a stored job
(stepscope.client): its steps are rolled up by the same analysis code.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from stepscope import schema
from stepscope.analysis.regression.gate import JobData, job_from_steps

_POLARS_TYPES = {"str": pl.String, "int": pl.Int64, "float": pl.Float64, "json": pl.String}


class StepsFileError(Exception):
    """A records file (steps, collectives) that is missing, unreadable or not canonical;
    said for a user."""


def scan_collectives_file(path: Path) -> pl.LazyFrame:
    """A canonical collectives file (parquet or CSV), lazily, with every optional column of
    schema.COLLECTIVES: a file written before per-group records has group
    schema.DEFAULT_GROUP (as has a row whose group is null) and nulls in the others."""
    if not path.is_file():
        raise StepsFileError(f"no such file: {path}")
    types = {c.name: _POLARS_TYPES[c.dtype] for c in schema.COLLECTIVES.columns}
    strings = {name: t for name, t in types.items() if t == pl.String}
    try:
        if path.suffix == ".csv":  # a group named "0" is a string, not a number
            frame = pl.scan_csv(path, schema_overrides=strings)
        else:
            frame = pl.scan_parquet(path)
        present = set(frame.collect_schema().names())
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise StepsFileError(f"cannot read {path}: {exc}") from None
    optional = [c.name for c in schema.COLLECTIVES.columns if not c.required]
    return frame.with_columns(
        *(
            pl.col(n).cast(types[n]) if n in present else pl.lit(None, dtype=types[n]).alias(n)
            for n in optional
        )
    ).with_columns(pl.col("group").fill_null(schema.DEFAULT_GROUP))


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
