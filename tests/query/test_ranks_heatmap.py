"""rank_table and heatmap equal polars over the raw rows."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from stepscope import query
from stepscope.query.heatmaps import decode_values
from stepscope.synthetic.generate import node_name
from tests.jobs import RANKS_PER_NODE, STRAGGLER
from tests.query.conftest import JOB, NUM_RANKS, NUM_STEPS, Stored

METRICS = ("step_s", "data_s", "comm_wait_s", "compute_s")


def test_rank_table_components_are_medians_of_bucket_means_and_means(stored: Stored) -> None:
    table = query.rank_table(stored.engine, JOB)
    width = table.bucket_steps
    assert width == 2  # 1,100 steps in at most 1,024 buckets
    buckets = stored.steps.group_by("rank", (pl.col("step") // width).alias("bucket")).agg(
        pl.col(m).mean() for m in METRICS
    )
    medians = buckets.group_by("rank").agg(pl.col(m).median() for m in METRICS).sort("rank")
    means = stored.steps.group_by("rank").agg(pl.col(m).mean() for m in METRICS).sort("rank")
    order = np.argsort(table.rank)

    np.testing.assert_array_equal(table.rank[order], np.arange(NUM_RANKS))
    for m in METRICS:  # buckets keep float32 sums
        np.testing.assert_allclose(table.median[m][order], medians[m].to_numpy(), rtol=1e-5)
        np.testing.assert_allclose(table.mean[m][order], means[m].to_numpy(), rtol=1e-5)
    job_median = np.median(medians["compute_s"].to_numpy())
    np.testing.assert_allclose(
        table.compute_excess[order], medians["compute_s"].to_numpy() / job_median - 1, atol=1e-6
    )
    assert [table.node[i] for i in order] == [node_name(r // RANKS_PER_NODE) for r in range(16)]


def test_rank_table_puts_the_straggler_first_with_its_finding(stored: Stored) -> None:
    table = query.rank_table(stored.engine, JOB)
    found = {f.id: f for f in query.findings(stored.engine, JOB)}

    assert table.rank[0] == STRAGGLER
    assert table.compute_excess[0] > 0.2
    assert any(found[i].kind == "straggler_rank" for i in table.finding_ids[0])
    for rank, ids in zip(table.rank.tolist(), table.finding_ids, strict=True):
        node = table.node[table.rank.tolist().index(rank)]
        assert ids == [i for i, f in found.items() if rank in f.ranks or f.node == node]


def test_slowest_shares_count_the_steps_each_rank_was_slowest(stored: Stored) -> None:
    table = query.rank_table(stored.engine, JOB)
    slowest = (
        stored.steps.sort("step", "rank")
        .group_by("step")
        .agg(pl.col("rank").get(pl.col("step_s").arg_max()).alias("rank"))
    )
    counts = dict(slowest.group_by("rank").len().iter_rows())
    for rank, share in zip(table.rank.tolist(), table.slowest_share, strict=True):
        assert share * NUM_STEPS == pytest.approx(counts.get(rank, 0))
    assert table.slowest_share.sum() == pytest.approx(1.0)


def direct_cells(stored: Stored, hm: query.Heatmap, metric: str, stat: str) -> np.ndarray:
    """The heatmap's cells computed from raw rows over its rank groups and step edges."""
    rows = np.repeat(np.arange(hm.row_starts.size - 1), np.diff(hm.row_starts))
    row_of = pl.DataFrame({"rank": hm.rank_order, "row": rows})
    steps = stored.steps.filter(pl.col("step").is_between(hm.step_edges[0], hm.step_edges[-1] - 1))
    col = np.searchsorted(hm.step_edges, steps["step"].to_numpy(), side="right") - 1
    agg = pl.col(metric).mean() if stat == "mean" else pl.col(metric).max()
    cells = (
        steps.with_columns(pl.Series("col", col))
        .join(row_of, on="rank")
        .group_by("row", "col")
        .agg(agg.alias("value"))
    )
    out = np.full(hm.values.shape, np.nan)
    out[cells["row"].to_numpy(), cells["col"].to_numpy()] = cells["value"].to_numpy()
    return out


@pytest.mark.parametrize("stat", ["mean", "max"])
@pytest.mark.parametrize(("max_ranks", "max_steps"), [(1024, 1000), (8, 100), (5, 7)])
def test_heatmap_cells_equal_polars_over_the_same_ranks_and_steps(
    stored: Stored, stat: str, max_ranks: int, max_steps: int
) -> None:
    hm = query.heatmap(
        stored.engine, JOB, "compute_s", stat=stat, max_ranks=max_ranks, max_steps=max_steps
    )
    assert hm is not None
    assert hm.values.shape[0] <= max_ranks
    assert hm.values.shape[1] <= max_steps
    assert hm.step_edges[0] == 0
    assert hm.step_edges[-1] == NUM_STEPS
    assert hm.values.shape[1] == hm.step_edges.size - 1
    np.testing.assert_allclose(hm.values, direct_cells(stored, hm, "compute_s", stat), rtol=1e-5)


def test_heatmap_rows_group_a_nodes_ranks_together(stored: Stored) -> None:
    hm = query.heatmap(stored.engine, JOB, "compute_s", max_ranks=8)
    assert hm is not None
    assert hm.values.shape == (8, NUM_STEPS // 2)  # two ranks a row, two-step buckets
    nodes = [node_name(int(r) // RANKS_PER_NODE) for r in hm.rank_order]
    assert nodes == sorted(nodes)
    assert hm.nodes == [node_name(i // 2) for i in range(8)]
    straggler_row = int(np.searchsorted(hm.row_starts, hm.rank_order.tolist().index(5), "right"))
    late = hm.step_edges[:-1] >= 400
    row_means = np.nanmean(hm.values[:, late], axis=1)
    assert int(np.argmax(row_means)) == straggler_row - 1


def test_a_step_range_selects_the_buckets_it_overlaps(stored: Stored) -> None:
    hm = query.heatmap(stored.engine, JOB, "data_s", from_step=101, to_step=160)
    assert hm is not None
    np.testing.assert_array_equal(hm.step_edges, np.arange(100, 163, 2))
    np.testing.assert_allclose(hm.values, direct_cells(stored, hm, "data_s", "mean"), rtol=1e-5)


def test_encoded_heatmap_decodes_within_the_quantisation_step(stored: Stored) -> None:
    hm = query.heatmap(stored.engine, JOB, "compute_s", max_steps=300)
    assert hm is not None
    values = hm.values.copy()
    values[3, 10] = np.nan  # an empty cell
    hm = query.Heatmap(**{**{f: getattr(hm, f) for f in hm.__dataclass_fields__}, "values": values})
    doc = json.loads(json.dumps(hm.encode()))
    lo, hi = doc["scale"]

    decoded = decode_values(doc)
    assert np.isnan(decoded[3, 10])
    assert np.isfinite(decoded).sum() == np.isfinite(values).sum()
    np.testing.assert_allclose(decoded, values, atol=(hi - lo) / 254 / 2 * 1.001)
    assert doc["ranks"] == hm.ranks.tolist()
    assert doc["step_edges"] == hm.step_edges.tolist()


def test_bad_heatmap_arguments_name_the_argument(stored: Stored) -> None:
    with pytest.raises(ValueError, match="metric must be one of"):
        query.heatmap(stored.engine, JOB, "mfu")
    with pytest.raises(ValueError, match="stat must be one of mean, max"):
        query.heatmap(stored.engine, JOB, stat="p50")
    with pytest.raises(ValueError, match="max_ranks must be >= 1"):
        query.heatmap(stored.engine, JOB, max_ranks=0)
