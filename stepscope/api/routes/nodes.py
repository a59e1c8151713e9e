"""Fleet health (#21): nodes ranked by their own effect on step time, and one node."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import APIRouter, Path, Query

from stepscope.api.deps import NO_NUL, EngineDep, ReadAuth
from stepscope.api.errors import NODE_RESPONSES
from stepscope.api.fleet_read import NodeDetailRead, NodesPage
from stepscope.query import fleet

if TYPE_CHECKING:
    NodeSort = str
else:
    NodeSort = Literal[tuple(s for k in fleet.SORT_KEYS for s in (k, f"-{k}"))]

router = APIRouter(tags=["nodes"], responses=NODE_RESPONSES)


@router.get("/nodes", summary="Nodes by their own effect on step time")
def list_nodes(
    engine: EngineDep,
    _auth: ReadAuth,
    suspect: Annotated[bool, Query(description="Only the suspects")] = False,
    name: Annotated[
        str | None, Query(max_length=1024, pattern=NO_NUL, description="Substring of the name")
    ] = None,
    min_effect: Annotated[float | None, Query(ge=-1, le=10)] = None,
    min_confidence: Annotated[float | None, Query(ge=0, le=1)] = None,
    min_jobs: Annotated[int | None, Query(ge=0, le=10**9)] = None,
    sort: Annotated[NodeSort, Query(description="A key; a leading '-' sorts descending")] = (
        "-effect"
    ),
    limit: Annotated[int, Query(ge=1, le=100_000)] = 100,
) -> NodesPage:
    """Every node's effect (relative, shrunk), confidence and since-when, from the node
    levels of every stored job (docs/fleet.md)."""
    filters = fleet.NodeFilters(
        suspect=suspect,
        name_contains=name,
        min_effect=min_effect,
        min_confidence=min_confidence,
        min_jobs=min_jobs,
    )
    return NodesPage.of(fleet.list_nodes(engine, filters, sort=sort, limit=limit))


@router.get("/nodes/{node}", summary="One node: its effect, jobs, GPUs and findings")
def node_detail(
    engine: EngineDep,
    _auth: ReadAuth,
    node: Annotated[str, Path(min_length=1, max_length=1024, pattern=NO_NUL)],
) -> NodeDetailRead:
    """The node's fitted effect, its level in each job over time, its GPUs (NVML UUIDs,
    where the profilers sent them) and the findings of its jobs that name it or its ranks."""
    return NodeDetailRead.of(fleet.node_detail(engine, node))
