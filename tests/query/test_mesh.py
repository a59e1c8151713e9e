"""Per-group collectives, the job's mesh, and heatmaps and rank tables grouped by node or by
a mesh dimension, against polars over the raw rows of a job on a 2 × 2 × 2 mesh."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import sqlalchemy as sa

from stepscope import query
from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.schema import busbw_factor
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.synthetic.generate import node_name, to_frames
from tests.jobs import (
    MESH_BYTES,
    MESH_CALLS,
    NUM_RANKS,
    STRAGGLER,
    mesh_job,
    mesh_of,
    step_rows,
    store_mesh_job,
)
from tests.support import fresh_postgres_database

JOB = "mesh-a"
FACTORS = {op: busbw_factor(op, 2) for op in ("all_reduce", "all_gather")}


@dataclass(frozen=True, slots=True)
class MeshStored:
    engine: sa.Engine
    steps: pl.DataFrame
    collectives: pl.DataFrame


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MeshStored]:
    """The mesh job stored through the wire path and analysed, on each engine."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            path: Path = tmp_path_factory.mktemp("mesh") / "stepscope.db"
            url = f"sqlite:///{path}"
        else:
            url = stack.enter_context(fresh_postgres_database())
        engine = make_engine(url)
        stack.callback(engine.dispose)
        upgrade(engine)
        job = mesh_job(JOB)
        store_mesh_job(engine, job)
        JobAnalyzer(engine, JOB, grace_s=0).run()
        yield MeshStored(
            engine=engine,
            steps=step_rows(job),
            collectives=to_frames(job)["collectives"].with_columns(
                pl.col("busy_s").cast(pl.Float64)
            ),
        )


def coordinate(dim: str) -> pl.Expr:
    """The rank's coordinate in `dim`, as mesh_of has it."""
    values = {r: mesh_of(r)[dim][0] for r in range(NUM_RANKS)}
    return pl.col("rank").replace_strict(values, return_dtype=pl.Int64)


def test_the_mesh_has_each_rank_s_coordinates(mesh: MeshStored) -> None:
    m = query.job_mesh(mesh.engine, JOB)

    assert m.dims == ["pp", "dp", "tp"]
    assert m.sizes.tolist() == [2, 2, 2]
    assert m.ranks.tolist() == list(range(NUM_RANKS))
    assert m.coords.tolist() == [[mesh_of(r)[d][0] for d in m.dims] for r in range(NUM_RANKS)]
    assert m.group_by == ["rank", "node", "pp", "dp", "tp"]


def test_a_job_without_a_mesh_has_no_dimension(mesh: MeshStored) -> None:
    other = "no-mesh"
    job = mesh_job(other, num_ranks=NUM_RANKS, num_steps=20)
    from tests.query.conftest import write

    write(mesh.engine, job, steps_per_batch=20)
    m = query.job_mesh(mesh.engine, other)

    assert m.dims == []
    assert m.coords.shape == (NUM_RANKS, 0)
    assert m.group_by == ["rank", "node"]
    with pytest.raises(ValueError, match="group_by must be one of rank, node; got 'tp'"):
        query.heatmap(mesh.engine, other, group_by="tp")


@pytest.mark.parametrize(
    ("group_by", "rows", "groups"),
    [
        ("pp", [[0, 1, 2, 3], [4, 5, 6, 7]], ["0", "1"]),
        ("dp", [[0, 1, 4, 5], [2, 3, 6, 7]], ["0", "1"]),
        ("tp", [[0, 2, 4, 6], [1, 3, 5, 7]], ["0", "1"]),
        ("node", [[0, 1, 2, 3], [4, 5, 6, 7]], [node_name(0), node_name(1)]),
    ],
)
def test_a_heatmap_grouped_by_a_mesh_dim_or_node_is_the_mean_over_each_group_s_ranks(
    mesh: MeshStored, group_by: str, rows: list[list[int]], groups: list[str]
) -> None:
    hm = query.heatmap(mesh.engine, JOB, "compute_s", group_by=group_by, max_steps=40)
    assert hm is not None
    edges = hm.step_edges
    column = (pl.col("step") - int(edges[0])) // int(edges[1] - edges[0])

    assert hm.group_by == group_by
    assert hm.groups == groups
    for i, ranks in enumerate(rows):
        assert hm.rank_order[hm.row_starts[i] : hm.row_starts[i + 1]].tolist() == ranks
        expected = (
            mesh.steps.filter(pl.col("rank").is_in(ranks), pl.col("step") < edges[-1])
            .group_by(column.alias("col"))
            .agg(pl.col("compute_s").mean())
            .sort("col")
        )
        np.testing.assert_allclose(hm.values[i], expected["compute_s"].to_numpy(), rtol=1e-5)
    doc = hm.encode()
    assert (doc["group_by"], doc["groups"]) == (group_by, groups)


def test_a_heatmap_by_rank_has_no_groups(mesh: MeshStored) -> None:
    hm = query.heatmap(mesh.engine, JOB, "compute_s")
    assert hm is not None

    assert (hm.group_by, hm.groups) == ("rank", None)
    assert hm.ranks.tolist() == list(range(NUM_RANKS))


def test_grouping_by_a_dim_the_mesh_lacks_names_the_parameter(mesh: MeshStored) -> None:
    with pytest.raises(ValueError, match="group_by must be one of rank, node, pp, dp, tp"):
        query.heatmap(mesh.engine, JOB, group_by="ep")
    with pytest.raises(ValueError, match="group_by"):
        query.rank_groups(mesh.engine, JOB, "ep")


def test_rank_groups_by_stage_are_each_stage_s_median_and_slowest_rank(
    mesh: MeshStored,
) -> None:
    groups = query.rank_groups(mesh.engine, JOB, "pp")
    table = query.rank_table(mesh.engine, JOB)
    median = dict(zip(table.rank.tolist(), table.median["compute_s"].tolist(), strict=True))
    at = groups.group.index(str(mesh_of(STRAGGLER)["pp"][0]))
    own_work = groups.median["data_s"] + groups.median["compute_s"]

    assert set(groups.group) == {"0", "1"}
    assert own_work[0] >= own_work[1]  # slowest first
    assert groups.ranks[at] == [4, 5, 6, 7]
    assert groups.slowest_rank[at] == STRAGGLER
    assert groups.max["compute_s"][at] == pytest.approx(median[STRAGGLER])
    for i, ranks in enumerate(groups.ranks):
        values = [median[r] for r in ranks]
        assert groups.median["compute_s"][i] == pytest.approx(float(np.median(values)))
        assert groups.max["compute_s"][i] == pytest.approx(max(values))
    middle = float(np.median(groups.median["compute_s"]))
    assert groups.compute_excess[0] == pytest.approx(groups.median["compute_s"][0] / middle - 1)
    assert groups.excess_s["compute_s"][0] == pytest.approx(groups.median["compute_s"][0] - middle)
    share = dict(zip(table.rank.tolist(), table.slowest_share.tolist(), strict=True))
    for i, ranks in enumerate(groups.ranks):
        assert groups.slowest_share[i] == pytest.approx(sum(share[r] for r in ranks))
    assert sum(groups.slowest_share) == pytest.approx(1.0)


def test_rank_groups_by_node_name_the_nodes(mesh: MeshStored) -> None:
    groups = query.rank_groups(mesh.engine, JOB, "node")
    at = groups.group.index(node_name(STRAGGLER // 4))

    assert set(groups.group) == {node_name(0), node_name(1)}
    assert groups.slowest_rank[at] == STRAGGLER
    assert groups.ranks[at] == [r for r in range(NUM_RANKS) if r // 4 == STRAGGLER // 4]


def test_collectives_are_per_group_label_and_op(mesh: MeshStored) -> None:
    stats = query.collective_stats(mesh.engine, JOB)
    sizes = stats.sizes
    c = mesh.collectives.with_columns(
        # bus bandwidth of groups of 2: all_reduce × 1, all_gather × 1/2
        (pl.col("bytes") / pl.col("busy_s") * pl.col("op").replace_strict(FACTORS)).alias("bw"),
        pl.col("mesh_dim").alias("label"),
    )
    per_step = c.group_by("label", "step").agg(
        pl.col("bw").median(), pl.col("bw").min().alias("lo")
    )

    assert list(zip(sizes.group, sizes.op, strict=True)) == [
        ("dp", "all_reduce"),
        ("tp", "all_gather"),
    ]
    assert sizes.size_log2.tolist() == [
        math.floor(math.log2(MESH_BYTES[d] / MESH_CALLS[d])) for d in ("dp", "tp")
    ]
    for i, label in enumerate(sizes.group):
        expected = per_step.filter(pl.col("label") == label)["bw"].median()
        assert sizes.busbw_p50_bps[i] == pytest.approx(expected, rel=1e-9)
    assert [(s.group, s.op) for s in stats.series] == [("dp", "all_reduce"), ("tp", "all_gather")]
    tp = per_step.filter(pl.col("label") == "tp").sort("step")
    np.testing.assert_allclose(stats.series[1].busbw_min_bps, tp["lo"].to_numpy(), rtol=1e-9)
