"""Collectives on the (steps × ranks) grid: per-rank finish times, and slow_collective.

A collective cannot complete before its last rank arrives, so the smallest busy time over
ranks for a (step, op) is the best estimate of the transfer itself; busbw follows the
nccl-tests conventions (stepscope.schema.busbw_factor). A rank's rows of one op in several
process groups (FSDP's all-gathers in its dp group, TP's in its tp group) are summed where a
matrix per op is needed; slow_collective compares each op per group label.

Point-to-point calls (a pipeline's send and recv) are not collectives in that sense: each
lasts until its one peer gets to it, and the peers of one rank do not finish together. A
stage's sends to a slow neighbour last as long as the neighbour is late, on every
micro-batch, so their summed busy time measures the neighbour's schedule, not the link; its
receives from it are its wait (comm_wait_s). Finish times, transfer times and busbw
findings are therefore taken from collectives only.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
from numpy.typing import NDArray

from stepscope.analysis.config import AnalysisConfig
from stepscope.analysis.frames.grid import Grid, Ints, Matrix, nanmedian
from stepscope.analysis.stats.runs import offset, onset, runs
from stepscope.schema import DEFAULT_GROUP, Finding, busbw_factor, group_label

_MAX_BYTES_RANKS = 64
POINT_TO_POINT = frozenset({"send", "recv"})
"""Ops whose calls each end when their one peer gets to them (see the module's docstring)."""

GROUP_COLUMNS: dict[str, type[pl.DataType]] = {
    "group": pl.String,
    "wait_s": pl.Float64,
    "first_seq": pl.Int64,
    "mesh_dim": pl.String,
    "group_ranks": pl.String,
}
"""The per-group columns of collectives rows (stepscope.schema.COLLECTIVES), which rows of
older profilers and files lack."""


def with_groups(collectives: pl.DataFrame) -> pl.DataFrame:
    """The rows with every per-group column: `group` DEFAULT_GROUP where absent or null, the
    others null where absent."""
    missing = [
        pl.lit(DEFAULT_GROUP if c == "group" else None, dtype=t).alias(c)
        for c, t in GROUP_COLUMNS.items()
        if c not in collectives.columns
    ]
    rows = collectives.with_columns(missing) if missing else collectives
    if rows["group"].null_count():
        rows = rows.with_columns(pl.col("group").fill_null(DEFAULT_GROUP))
    return rows


def is_constant(column: pl.Series) -> bool:
    """Every value equal to the first (nulls included): cheaper than hashing the strings."""
    if column.len() == 0:
        return True
    first = column[0]
    if first is None:
        return column.null_count() == column.len()
    return column.null_count() == 0 and not (column != first).any()


def group_labels(collectives: pl.DataFrame) -> pl.Series:
    """Each row's schema.group_label(group, mesh_dim), as a Series named `group`."""
    rows = with_groups(collectives)
    if is_constant(rows["group"]) and is_constant(rows["mesh_dim"]):
        label = group_label(rows["group"][0], rows["mesh_dim"][0]) if rows.height else ""
        return pl.Series("group", [label] * rows.height, dtype=pl.String)
    pairs = rows.select("group", "mesh_dim").unique()
    pairs = pairs.with_columns(
        pl.Series(
            "_label",
            [group_label(g, m) for g, m in pairs.iter_rows()],
            dtype=pl.String,
        )
    )
    labelled = rows.select("group", "mesh_dim").join(
        pairs, on=["group", "mesh_dim"], how="left", nulls_equal=True, maintain_order="left"
    )
    return labelled["_label"].alias("group")


def summed_over_groups(collectives: pl.DataFrame) -> pl.DataFrame:
    """One row per (rank, step, op): a rank's rows of an op in several groups summed (calls,
    bytes, busy time; the largest group size), ordered by (rank, step, op)."""
    if "group" not in collectives.columns or is_constant(collectives["group"]):
        return collectives
    return (
        collectives.lazy()
        .group_by("rank", "step", "op")
        .agg(
            pl.col("group_size").max(),
            pl.col("count", "bytes", "busy_s").sum(),
        )
        .sort("rank", "step", "op")
        .collect()
    )


@dataclass(kw_only=True, slots=True)
class OpGrid:
    """One collective op over the grid: busy time per (step, rank), payload per step."""

    op: str
    group_size: int
    busy_s: Matrix
    bytes: NDArray[np.float32]
    """Payload per rank per step (median over ranks)."""
    count: NDArray[np.float32]
    """Calls per step (median over ranks)."""

    @property
    def factor(self) -> float:
        return busbw_factor(self.op, self.group_size)

    def rows(self, a: int, b: int) -> OpGrid:
        """Steps a..b-1 of the grid, as views."""
        return OpGrid(
            op=self.op,
            group_size=self.group_size,
            busy_s=self.busy_s[a:b],
            bytes=self.bytes[a:b],
            count=self.count[a:b],
        )


def op_grids(collectives: pl.DataFrame, grid: Grid, start: int) -> list[OpGrid]:
    """Each op of `collectives` placed on `grid`, keeping step rows from `start` (a rank's
    rows of an op in several groups summed)."""
    collectives = summed_over_groups(collectives)
    op_column = collectives["op"]
    first_op = op_column[0]
    # Most jobs have one op: comparing with the first spares hashing millions of strings.
    single = not (op_column != first_op).any()
    ops = [first_op] if single else op_column.unique().sort().to_list()
    # Payload and calls per step are medians over a sample of ranks (they barely differ).
    sample_ranks = grid.ranks[:: max(1, grid.ranks.size // _MAX_BYTES_RANKS)]
    post_steps = grid.steps[start:]
    out = []
    for op in ops:
        rows = collectives if single else collectives.filter(pl.col("op") == op)
        placed, keep = grid.placed(rows["rank"].to_numpy(), rows["step"].to_numpy())
        per_step = (
            rows.lazy()
            .filter(pl.col("rank").is_in(sample_ranks) & (pl.col("step") >= int(post_steps[0])))
            .group_by("step")
            .agg(pl.col("bytes").median(), pl.col("count").median())
            .collect()
        )
        step = per_step["step"].to_numpy()
        at = np.minimum(np.searchsorted(post_steps, step), post_steps.size - 1)
        on_grid = post_steps[at] == step

        def on_steps(column: str) -> NDArray[np.float32]:
            values = np.full(post_steps.size, np.nan, dtype=np.float32)
            values[at[on_grid]] = per_step[column].to_numpy()[on_grid]  # noqa: B023
            return values

        group_size = int(rows["group_size"].max() or 0)  # type: ignore[arg-type]
        out.append(
            OpGrid(
                op=op,
                group_size=group_size,
                busy_s=placed.matrix(rows["busy_s"].to_numpy(), keep)[start:],
                bytes=on_steps("bytes"),
                count=on_steps("count"),
            )
        )
    return out


def finish_times(ops: list[OpGrid], ready_s: Matrix | None) -> Matrix | None:
    """When each rank's collectives of the step were done: ready time + busy time; None when
    every op is point-to-point."""
    collectives = [g for g in ops if g.op not in POINT_TO_POINT]
    if not collectives:
        return None
    total = np.zeros_like(collectives[0].busy_s)
    seen = np.zeros(total.shape, dtype=bool)
    for g in collectives:
        present = ~np.isnan(g.busy_s)
        np.add(total, g.busy_s, out=total, where=present)
        seen |= present
    total[~seen] = np.nan
    return total if ready_s is None else total + ready_s


def transfer_times(ops: list[OpGrid]) -> NDArray[np.float32] | None:
    """Per step, the smallest busy time over ranks (the transfer itself), summed over the
    collective ops; None when every op is point-to-point."""
    collectives = [g for g in ops if g.op not in POINT_TO_POINT]
    if not collectives:
        return None
    total = np.zeros(collectives[0].busy_s.shape[0], dtype=np.float32)
    for g in collectives:
        busy = np.where(np.isnan(g.busy_s), np.inf, g.busy_s).min(axis=1)
        total += np.where(np.isfinite(busy), busy, 0.0).astype(np.float32)
    return total


class CommEvidence:
    """Per-op busy time and busbw of one rank over a range of steps, next to its peers'."""

    def __init__(self, ops: list[OpGrid], steps: Ints, ranks: Ints) -> None:
        self._ops = ops
        self._steps = steps
        self._ranks = ranks

    def __call__(self, rank: int, first_step: int, last_step: int) -> dict[str, Any]:
        r = int(np.searchsorted(self._ranks, rank))
        a, b = np.searchsorted(self._steps, [first_step, last_step + 1])
        out: dict[str, Any] = {}
        for g in self._ops:
            busy = g.busy_s[a:b]
            mine = nanmedian(busy[:, r])
            peers = nanmedian(np.delete(busy, r, axis=1)[:, :: max(1, busy.shape[1] // 256)])
            payload = nanmedian(g.bytes[a:b])
            entry: dict[str, float] = {"rank_busy_s": mine, "peers_busy_s": peers}
            if g.factor > 0 and mine > 0 and peers > 0:
                entry["rank_busbw_bps"] = payload * g.factor / mine
                entry["peers_busbw_bps"] = payload * g.factor / peers
            out[g.op] = entry
        return out


def slow_collective_findings(
    job_id: str, op_rollup: pl.DataFrame, first_step: int, config: AnalysisConfig
) -> list[Finding]:
    """Steps from `first_step` where an op's busbw (per message size) in a group label fell
    far below its norm or expectation; `op_rollup` is stepscope.analysis.rollups.op_rollup of
    the job (without a `group` column: every row is group "all"). Point-to-point ops are left
    out: their busy time includes waiting for the peer (a slow pipeline stage's neighbours'
    sends), which no busbw can tell from a slow link.

    The metric is "{op}.busbw_bps" (the group label in evidence["group"]), or
    "{label}.{op}.busbw_bps" for an op the job runs in several group labels (DDP's all-reduce
    in dp and TP's in tp), so that findings' keys stay distinct."""
    findings = []
    expected_bps = config.expected_busbw_bps or {}
    window = config.window_steps
    settled = op_rollup.filter(pl.col("step") >= first_step)
    if "group" not in settled.columns:
        settled = settled.with_columns(pl.lit(group_label(None, None)).alias("group"))
    parts = settled.partition_by("group", "op", as_dict=True)
    labels_per_op = Counter(str(op) for _, op in parts)
    for (label, op), rows in sorted(parts.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        if op in POINT_TO_POINT:
            continue
        group_size = int(rows["group_size"].max() or 0)  # type: ignore[arg-type]
        factor = busbw_factor(str(op), group_size)
        if factor == 0:
            continue
        steps = rows["step"].to_numpy()
        num_bytes = rows["bytes"].to_numpy()
        with np.errstate(all="ignore"):
            busbw = num_bytes * factor / rows["busy_s_min"].to_numpy()
            size_log2 = np.floor(np.log2(num_bytes / np.maximum(rows["count"].to_numpy(), 1.0)))
        valid = np.isfinite(busbw) & (busbw > 0) & np.isfinite(size_log2)
        for size in np.unique(size_log2[valid]):
            positions = np.flatnonzero(valid & (size_log2 == size))
            if positions.size < 2 * window:
                continue
            series = busbw[positions]
            usable = series.size // window * window
            window_medians = np.median(series[:usable].reshape(-1, window), axis=1)
            norm = expected_bps.get(str(op))
            source = "expected" if norm is not None else "job_p90"
            if norm is None:
                norm = float(np.quantile(window_medians, 0.9))
            limit = (1.0 - config.busbw_drop) * norm
            slow_windows = window_medians < limit
            flags = series < limit
            for w0, w1 in runs(slow_windows):
                lo = onset(flags, max(0, (w0 - 1) * window), (w0 + 1) * window - 1, 0.5)
                end = (w1 + 1) * window - 1
                ongoing = w1 == slow_windows.size - 1
                hi = (
                    series.size - 1
                    if ongoing
                    else offset(flags, lo, min(end + window, usable - 1), 0.5)
                )
                observed = float(np.median(series[lo : hi + 1]))
                effect = observed / norm - 1.0
                message_bytes = 2 ** int(size)
                findings.append(
                    Finding(
                        job_id=job_id,
                        kind="slow_collective",
                        severity="critical" if effect <= -0.5 else "warning",
                        first_step=int(steps[positions[lo]]),
                        last_step=None if ongoing else int(steps[positions[hi]]),
                        metric=f"{label}.{op}.busbw_bps"
                        if labels_per_op[str(op)] > 1
                        else f"{op}.busbw_bps",
                        expected=norm,
                        observed=observed,
                        effect=effect,
                        cause="communication",
                        evidence={
                            "op": op,
                            "group": label,
                            "group_size": group_size,
                            "message_bytes_log2": int(size),
                            "message_bytes_at_least": message_bytes,
                            "norm": source,
                            "steps": int(hi - lo + 1),
                        },
                    )
                )
    return [f for f in findings if math.isfinite(f.effect or 0.0)]
