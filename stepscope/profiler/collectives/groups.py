"""Process groups as the collective tap sees them: name, members, mesh dimension, sequence.

Every member of a process group issues its collectives in the same order, so a counter per
group that the tap advances at each call is the same on every member for the same call:
(group name, sequence number) names one collective across ranks without clock sync. The
group's name (`pg.group_name`) is assigned by c10d in the same order on every rank.

A `DeviceMesh` labels its groups: each mesh dimension's group is named after the dimension
(tp, dp_shard, pp, ...), and this rank's coordinate along it is reported once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from stepscope.schema import compact_ranks


@dataclass(slots=True)
class GroupInfo:
    """One process group, as recorded on every collective issued in it."""

    name: str
    size: int
    ranks: str
    """Members, compact (stepscope.schema.compact_ranks)."""
    seq: int = 0
    """Collectives issued in this group so far (send/recv not counted: they are pairwise)."""
    completed_seq: int = 0
    """The highest sequence number seen completed (the group's completed frontier)."""
    members: list[int] | None = None
    """Global ranks by group rank (send/recv name their peer by group rank); None if unknown."""


class GroupRegistry:
    """Groups by process-group object and by name, with the mesh's labels and coordinates."""

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[Any, GroupInfo]] = {}
        """id(ProcessGroup) → (it, its group); read directly on the collective tap's path."""
        self.by_name: dict[str, GroupInfo] = {}
        """Group name → its group; read directly by the functional-collective kernels."""
        self.mesh_dims: dict[str, str] = {}
        """Group name → the mesh dimension it spans."""
        self.mesh: dict[str, list[int]] = {}
        """This rank's mesh coordinates: dimension → [coordinate, size]."""
        self.channels: dict[tuple[str, str, int], GroupInfo] = {}
        """(group, op, peer's group rank) → the point-to-point channel (see `channel`)."""
        self._parents: dict[str, str] = {}
        """Channel name → the name of the group it belongs to."""

    def of(self, pg: Any) -> GroupInfo:
        """The group of a ProcessGroup object (looked up once per group)."""
        entry = self.by_id.get(id(pg))
        if entry is not None and entry[0] is pg:
            return entry[1]
        info = self.by_name.get(_name_of(pg))
        if info is None:
            info = _describe(pg)
            self.by_name[info.name] = info
        self.by_id[id(pg)] = (pg, info)  # holding pg keeps its id from being reused
        return info

    def named(self, name: str) -> GroupInfo:
        """The group called `name` (functional collectives name their group)."""
        info = self.by_name.get(name)
        if info is None:
            from torch._C._distributed_c10d import _resolve_process_group

            info = self.of(_resolve_process_group(name))  # type: ignore[arg-type]
        return info

    def channel(self, group: GroupInfo, op: str, peer: int) -> GroupInfo | None:
        """The channel of a send or recv: the messages one rank sends another in `group`,
        named "{group}:{src}>{dst}" by global ranks. Both ends count their own calls on it,
        so the k-th send and the k-th recv carry the same sequence number (None when the
        peer's global rank is unknown)."""
        key = (group.name, op, peer)
        found = self.channels.get(key)
        if found is not None:
            return found
        members = group.members
        if not members or not 0 <= peer < len(members):
            return None
        me, other = dist.get_rank(), members[peer]
        src, dst = (me, other) if op == "send" else (other, me)
        name = f"{group.name}:{src}>{dst}"
        found = GroupInfo(name=name, size=2, ranks=compact_ranks(sorted({src, dst})))
        self.channels[key] = found
        self._parents[name] = group.name
        return found

    def all_groups(self) -> list[GroupInfo]:
        """The process groups and the point-to-point channels seen so far."""
        return [*self.by_name.values(), *self.channels.values()]

    def mesh_dim(self, name: str) -> str | None:
        """The mesh dimension a group (or a channel's group) spans, if labelled."""
        return self.mesh_dims.get(self._parents.get(name, name))

    def add_mesh(self, mesh: Any) -> bool:
        """Label a DeviceMesh's groups with its dimension names and note this rank's
        coordinates; False when the mesh has no dimension names."""
        names = getattr(mesh, "mesh_dim_names", None)
        coordinate = mesh.get_coordinate()
        if not names or coordinate is None:
            return False
        for index, dim in enumerate(names):
            self.mesh_dims[str(mesh.get_group(index).group_name)] = str(dim)
            self.mesh[str(dim)] = [int(coordinate[index]), int(mesh.size(index))]
        return True

    def add_stage(self, stage_index: int, num_stages: int, group: Any) -> None:
        """A pipeline stage: this rank's coordinate along "pp", and its group's label.

        With several stages per rank (interleaved and V schedules: num_stages a multiple of
        the group's size) the coordinate is the rank's place in its pipeline group, as a
        DeviceMesh's "pp" dimension has it, whichever of its stages was built last; it is
        also the first stage it holds (stage r, r + size, ...; or r and 2 size - 1 - r)."""
        group = group if group is not None else dist.group.WORLD
        size = _size_of(group) if group is not None else 0
        if size and num_stages % size == 0:
            self.mesh["pp"] = [int(dist.get_rank(group)), size]
            self.mesh_dims[self.of(group).name] = "pp"
        else:
            self.mesh["pp"] = [int(stage_index), int(num_stages)]


def _name_of(pg: Any) -> str:
    try:
        return str(pg.group_name)
    except Exception:  # a group c10d does not know by name (not registered)
        return f"pg{id(pg):x}"


def _size_of(pg: Any) -> int:
    try:
        return int(pg.size())
    except Exception:
        return 0


def _describe(pg: Any) -> GroupInfo:
    try:
        members = dist.get_process_group_ranks(pg)
    except Exception:  # not a group registered with c10d: its members are unknown
        members = []
    return GroupInfo(
        name=_name_of(pg), size=_size_of(pg), ranks=compact_ranks(members), members=members
    )
