"""Findings as a table."""

from __future__ import annotations

import json
from collections.abc import Sequence

import polars as pl

from stepscope.schema import FINDINGS, Finding

_DTYPES = {"str": pl.String, "int": pl.Int64, "float": pl.Float64, "json": pl.String}


def findings_to_frame(findings: Sequence[Finding]) -> pl.DataFrame:
    """One row per finding with the columns of the findings table (ranks, evidence as JSON)."""
    rows = []
    for f in findings:
        row = f.to_dict()
        row["ranks"] = json.dumps(row["ranks"])
        row["evidence"] = json.dumps(row["evidence"], sort_keys=True)
        rows.append(row)
    schema = {c.name: _DTYPES[c.dtype] for c in FINDINGS.columns}
    return pl.DataFrame(rows, schema=schema)
