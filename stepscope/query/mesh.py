"""A job's DeviceMesh as its ranks reported it, and the groups of ranks a chart can show:
each rank, each node, or each coordinate of a mesh dimension."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sqlalchemy as sa
from numpy.typing import NDArray

from stepscope.query.common import check_choice, require_job
from stepscope.store import reads

BY_RANK = "rank"
BY_NODE = "node"
FIXED_GROUPINGS = (BY_RANK, BY_NODE)
"""What every job's ranks can be grouped by; a job with a mesh adds its dimensions."""

Ints = NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class Mesh:
    """The job's mesh dimensions (outer to inner, as the ranks sent them), each one's size,
    and every seen rank's coordinate in each (-1 where the rank sent none)."""

    dims: list[str]
    sizes: Ints
    ranks: Ints
    coords: NDArray[np.int64]
    """(ranks × dims)."""

    @property
    def group_by(self) -> list[str]:
        """What the job's ranks can be grouped by: rank, node, then each mesh dimension."""
        return [*FIXED_GROUPINGS, *self.dims]

    def coordinates(self, dim: str) -> dict[int, int]:
        """rank → coordinate in `dim` of the ranks that sent one."""
        column = self.coords[:, self.dims.index(dim)]
        return {int(r): int(c) for r, c in zip(self.ranks, column, strict=True) if c >= 0}


def job_mesh(engine: sa.Engine, job_id: str) -> Mesh:
    """The job's mesh from its ranks' `mesh` (no dimension when none sent one)."""
    require_job(engine, job_id)
    meshes = reads.read_meshes(engine, job_id)
    sizes: dict[str, int] = {}
    for mesh in meshes.values():
        for dim, (_coord, size) in (mesh or {}).items():
            sizes[dim] = max(sizes.get(dim, 0), int(size))
    dims = list(sizes)
    ranks = np.array(sorted(meshes), dtype=np.int64)
    coords = np.full((ranks.size, len(dims)), -1, dtype=np.int64)
    for i, rank in enumerate(ranks.tolist()):
        for j, dim in enumerate(dims):
            at = (meshes[rank] or {}).get(dim)
            if at is not None:
                coords[i, j] = int(at[0])
    return Mesh(
        dims=dims, sizes=np.array([sizes[d] for d in dims], dtype=np.int64), ranks=ranks,
        coords=coords,
    )  # fmt: skip


GroupKey = str | int | None
"""A rank's group: its node name, its coordinate in a mesh dimension, None when unknown."""


def group_keys(
    engine: sa.Engine, job_id: str, group_by: str, nodes: dict[int, str | None]
) -> dict[int, GroupKey] | None:
    """rank → its group's key for `group_by` (None for group_by="rank"); ValueError for a
    grouping the job does not have."""
    if group_by == BY_RANK:
        return None
    if group_by == BY_NODE:
        return dict(nodes)
    mesh = job_mesh(engine, job_id)
    check_choice("group_by", group_by, mesh.group_by)
    return dict(mesh.coordinates(group_by))


def display_order(
    ranks: Sequence[int], nodes: dict[int, str | None], keys: dict[int, GroupKey] | None
) -> list[int]:
    """Ranks by group (unknown last), then by node (none last), then rank."""

    def key(r: int) -> tuple[bool, str | int, bool, str, int]:
        group = None if keys is None else keys.get(r)
        node = nodes.get(r)
        return group is None, group if group is not None else 0, node is None, node or "", r

    return sorted(ranks, key=key)


def group_starts(order: Sequence[int], keys: dict[int, GroupKey] | None) -> Ints:
    """Offset in `order` (display_order) of each group's first rank: every rank's with
    group_by="rank"."""
    if keys is None:
        return np.arange(len(order), dtype=np.int64)
    grouped = [keys.get(r) for r in order]
    starts = [i for i, k in enumerate(grouped) if i == 0 or k != grouped[i - 1]]
    return np.array(starts, dtype=np.int64)
