"""The mesh, per-group collectives, and the heatmap and rank table grouped by node or by a
mesh dimension, over HTTP, for a job on a 2 × 2 × 2 mesh stored through the wire path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stepscope.query import decode_values
from stepscope.synthetic.generate import node_name
from tests.api.conftest import JOB, Api
from tests.jobs import NUM_RANKS, STRAGGLER, mesh_job, mesh_of, store_mesh_job

MESH_JOB = "api-mesh"


@pytest.fixture(scope="module")
def mesh_api(api: Api) -> Iterator[Api]:
    """The server of `api`, also holding the mesh job (analysed through the API) while this
    module runs: the other modules see only their jobs."""
    store_mesh_job(api.engine, mesh_job(MESH_JOB))
    response = api.client.post(f"/jobs/{MESH_JOB}/analyze", timeout=120)
    assert response.status_code == 200, response.text
    yield api
    assert api.client.delete(f"/jobs/{MESH_JOB}").status_code == 200


def test_mesh_lists_dims_coordinates_and_groupings(mesh_api: Api) -> None:
    body = mesh_api.client.get(f"/jobs/{MESH_JOB}/mesh").json()

    assert body["dims"] == ["pp", "dp", "tp"]
    assert body["sizes"] == [2, 2, 2]
    assert body["group_by"] == ["rank", "node", "pp", "dp", "tp"]
    assert body["ranks"] == list(range(NUM_RANKS))
    assert body["coords"] == [[mesh_of(r)[d][0] for d in body["dims"]] for r in body["ranks"]]


def test_a_job_without_a_mesh_groups_by_rank_or_node_only(mesh_api: Api) -> None:
    body = mesh_api.client.get(f"/jobs/{JOB}/mesh").json()
    bad = mesh_api.client.get(f"/jobs/{JOB}/heatmap", params={"group_by": "pp"})

    assert (body["dims"], body["group_by"]) == ([], ["rank", "node"])
    assert bad.status_code == 422
    assert bad.json()["errors"][0]["parameter"] == "group_by"
    assert "rank, node" in bad.json()["detail"]


def test_heatmap_by_stage_has_a_row_per_stage(mesh_api: Api) -> None:
    params = {"metric": "compute_s", "group_by": "pp"}
    body = mesh_api.client.get(f"/jobs/{MESH_JOB}/heatmap", params=params).json()
    by_rank = mesh_api.client.get(f"/jobs/{MESH_JOB}/heatmap", params={"metric": "compute_s"})
    ranks = decode_values(by_rank.json())

    assert body["group_by"] == "pp"
    assert body["groups"] == ["0", "1"]
    assert body["rank_order"] == list(range(NUM_RANKS))
    assert body["row_starts"] == [0, 4, 8]
    assert body["shape"][0] == 2
    lo, hi = body["scale"]
    stage = decode_values(body)[1]
    # every rank has every step: a stage's mean is the mean of its ranks' rows
    assert stage == pytest.approx(ranks[4:].mean(axis=0), abs=(hi - lo) / 127 + 1e-6)
    assert by_rank.json()["group_by"] == "rank"
    assert by_rank.json()["groups"] is None


def test_rank_table_by_node_has_both_nodes_and_every_rank(mesh_api: Api) -> None:
    body = mesh_api.client.get(f"/jobs/{MESH_JOB}/ranks", params={"group_by": "node"}).json()
    groups = {g["group"]: g for g in body["groups"]}
    mine = groups[node_name(STRAGGLER // 4)]

    assert body["group_by"] == "node"
    assert len(body["ranks"]) == NUM_RANKS
    assert sorted(groups) == [node_name(0), node_name(1)]
    assert mine["ranks"] == [4, 5, 6, 7]
    assert mine["slowest_rank"] == STRAGGLER
    assert mine["max_s"]["compute_s"] >= mine["median_s"]["compute_s"]
    plain = mesh_api.client.get(f"/jobs/{MESH_JOB}/ranks").json()
    assert (plain["group_by"], plain["groups"]) == ("rank", None)


def test_rank_table_by_an_unknown_dim_is_a_422(mesh_api: Api) -> None:
    response = mesh_api.client.get(f"/jobs/{MESH_JOB}/ranks", params={"group_by": "ep"})

    assert response.status_code == 422
    assert response.json()["errors"][0]["parameter"] == "group_by"
    assert "pp, dp, tp" in response.json()["detail"]


def test_collectives_are_per_group_label(mesh_api: Api) -> None:
    body = mesh_api.client.get(f"/jobs/{MESH_JOB}/collectives").json()

    assert [(s["group"], s["op"]) for s in body["sizes"]] == [
        ("dp", "all_reduce"),
        ("tp", "all_gather"),
    ]
    assert [(s["group"], s["op"]) for s in body["series"]] == [
        ("dp", "all_reduce"),
        ("tp", "all_gather"),
    ]
