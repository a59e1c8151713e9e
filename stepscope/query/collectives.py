"""Collective bandwidth of a job per process group and op, by message size and over steps,
from op rollups (a group is its label, schema.group_label: every tp group is "tp")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import sqlalchemy as sa
from numpy.typing import NDArray

from stepscope import schema
from stepscope.query.common import check_at_least, require_job
from stepscope.query.downsample import band_indices, finite
from stepscope.query.memo import per_pass
from stepscope.store import reads, tables

_COLUMNS = ["step", "group", "op", "group_size", "count", "bytes", "busy_s_min"]
_COLUMNS += ["busbw_min_bps", "busbw_p50_bps"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SizeStats:
    """Per (group, op, message-size bucket): steps and median bandwidths over those steps.

    The size bucket is floor(log2(bytes per call)), bytes per call being the median over
    ranks of a step's bytes / calls (-1 for calls without bytes). busbw_p50_bps is the
    median of the steps' median-rank bus bandwidth (waiting included);
    transfer_busbw_p50_bps and algbw_p50_bps use the fastest rank's busy time, the best
    estimate of pure transfer (nccl-tests conventions).
    """

    group: list[str]
    """The process group's label (schema.group_label)."""
    op: list[str]
    size_log2: NDArray[np.int64]
    num_steps: NDArray[np.int64]
    bytes_per_call_p50: NDArray[np.float64]
    busbw_p50_bps: NDArray[np.float64]
    transfer_busbw_p50_bps: NDArray[np.float64]
    algbw_p50_bps: NDArray[np.float64]


@dataclass(frozen=True, slots=True, kw_only=True)
class OpSeries:
    """An op's bus bandwidth in a group over steps: median and slowest rank, at most
    max_points."""

    group: str
    op: str
    step: NDArray[np.int64]
    busbw_p50_bps: NDArray[np.float64]
    busbw_min_bps: NDArray[np.float64]


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveStats:
    """A job's collectives: bandwidth per (group, op) and size bucket, and per (group, op)
    over steps."""

    sizes: SizeStats
    series: list[OpSeries]


@per_pass
def collective_stats(engine: sa.Engine, job_id: str, *, max_points: int = 2000) -> CollectiveStats:
    """Bandwidth per (group, op) and message size, and each (group, op)'s bandwidth over
    steps (downsampled keeping the global max of the median and the global min of the
    slowest rank)."""
    check_at_least("max_points", max_points, 2)
    require_job(engine, job_id)
    ops = reads.read_rollup(engine, tables.op_rollups, job_id, columns=_COLUMNS)
    # Rollups stored before per-group rows have group "": the group is not known.
    unknown = schema.group_label(schema.DEFAULT_GROUP, None)
    ops = ops.filter(pl.col("op") != "barrier").with_columns(
        pl.when(pl.col("group") == "").then(pl.lit(unknown)).otherwise("group").alias("group")
    )
    groups = ops.select("op", "group_size").unique()
    factors = groups.with_columns(
        pl.Series(
            "factor",
            [schema.busbw_factor(op, n or 0) for op, n in groups.iter_rows()],
            dtype=pl.Float64,
        )
    )
    transfer_s = pl.when(pl.col("busy_s_min") > 0).then(pl.col("busy_s_min"))
    per_call = pl.col("bytes") / pl.col("count")
    sizes = (
        ops.join(factors, on=["op", "group_size"], how="left", nulls_equal=True)
        .with_columns(
            (pl.col("bytes") / transfer_s).alias("algbw"),
            per_call.alias("per_call"),
            pl.when(per_call > 0).then(per_call.log(2).floor()).cast(pl.Int64).alias("size_log2"),
        )
        .group_by("group", "op", "size_log2")
        .agg(
            pl.len().cast(pl.Int64).alias("num_steps"),
            pl.col("per_call").median().alias("bytes_per_call_p50"),
            pl.col("busbw_p50_bps").median(),
            (pl.col("algbw") * pl.col("factor")).median().alias("transfer_busbw_p50_bps"),
            pl.col("algbw").median().alias("algbw_p50_bps"),
        )
        .sort("group", "op", "size_log2", nulls_last=True)
    )

    def floats(name: str) -> NDArray[np.float64]:
        return sizes[name].cast(pl.Float64).fill_null(np.nan).to_numpy()

    series = []
    by_group_op = ops.sort("group", "op", "step").group_by("group", "op", maintain_order=True)
    for (group, op), rows in by_group_op:
        step = rows["step"].to_numpy()
        p50 = rows["busbw_p50_bps"].fill_null(np.nan).to_numpy()
        low = rows["busbw_min_bps"].fill_null(np.nan).to_numpy()
        keep = finite(p50, low)
        step, p50, low = step[keep], p50[keep], low[keep]
        picked = band_indices(step, low, p50, max_points)
        series.append(
            OpSeries(
                group=str(group),
                op=str(op),
                step=step[picked],
                busbw_p50_bps=p50[picked],
                busbw_min_bps=low[picked],
            )
        )
    return CollectiveStats(
        sizes=SizeStats(
            group=sizes["group"].to_list(),
            op=sizes["op"].to_list(),
            size_log2=sizes["size_log2"].fill_null(-1).to_numpy(),
            num_steps=sizes["num_steps"].to_numpy(),
            bytes_per_call_p50=floats("bytes_per_call_p50"),
            busbw_p50_bps=floats("busbw_p50_bps"),
            transfer_busbw_p50_bps=floats("transfer_busbw_p50_bps"),
            algbw_p50_bps=floats("algbw_p50_bps"),
        ),
        series=series,
    )
