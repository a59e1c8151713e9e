"""What the profiler records of one collective, whoever timed it (the tap or DDP's timers)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .groups import GroupInfo
from .timer import Mark


@dataclass(slots=True)
class CollectiveCall:
    """One collective as this rank saw it."""

    op: str
    """One of schema.COLLECTIVE_OPS."""
    group: GroupInfo
    num_bytes: int
    """Payload per rank, nccl-tests convention (all_gather: the gathered output)."""
    start: Mark
    """When it was issued (DDP: when its gradients were ready)."""
    end: Mark | None = None
    """When it completed; None until then."""
    seq: int | None = None
    """Its sequence number in the group (None for send/recv and DDP's timers)."""
    waits: list[tuple[Mark, Mark]] = field(default_factory=list)
    """Spans the training thread sat blocked waiting for it."""
    ddp_bucket: bool = False
    """DDP gradients: exposed from the last bucket's start to the last bucket's end."""
    count: int = 1
    """Collectives this call stands for (DdpStepTimer: the step's buckets)."""
    channel: GroupInfo | None = None
    """send/recv: the channel to or from its peer (GroupRegistry.channel)."""
    channel_seq: int = 0
    """send/recv: its sequence number on the channel."""


Record = Callable[[CollectiveCall], None]


def tensor_bytes(tensor: Any) -> int:
    """Bytes of a tensor (0 for anything else)."""
    if isinstance(tensor, torch.Tensor):
        return int(tensor.nbytes)
    return 0


def tensors_bytes(tensors: Any) -> int:
    """Bytes of a tensor, or of a (nested) list of tensors."""
    # On every collective's path: a loop, not a generator, and no call per tensor.
    if isinstance(tensors, torch.Tensor):
        return int(tensors.nbytes)
    if not isinstance(tensors, list | tuple):
        return 0
    total = 0
    for item in tensors:
        total += item.nbytes if isinstance(item, torch.Tensor) else tensors_bytes(item)
    return total
