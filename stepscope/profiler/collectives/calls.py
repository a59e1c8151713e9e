"""What the profiler records of one collective, whoever timed it (the tap or DDP's timers)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stepscope.profiler.collectives.groups import GroupInfo
from stepscope.profiler.timer import Mark


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
    waits: list[tuple[Mark, Mark]] | None = None
    """On a device clock, the spans the training thread sat blocked waiting for it (None until
    the first)."""
    ddp_bucket: bool = False
    """DDP gradients: exposed from the last bucket's start to the last bucket's end."""
    count: int = 1
    """Collectives this call stands for (DdpStepTimer: the step's buckets)."""
    channel: GroupInfo | None = None
    """send/recv: the channel to or from its peer (GroupRegistry.channel)."""
    channel_seq: int = 0
    """send/recv: its sequence number on the channel."""
    wait_s: float = 0.0
    """On the CPU clock, the seconds the training thread sat blocked waiting for it, added at
    each wait's end: a float where a list of spans would be 2 more objects a collective for
    the garbage collector to count until the step is shipped."""


Record = Callable[[CollectiveCall], None]


_Tensor = torch.Tensor


def tensor_bytes(tensor: Any) -> int:
    """Bytes of a tensor (0 for anything else)."""
    return int(tensor.nbytes) if isinstance(tensor, _Tensor) else 0


def tensors_bytes(tensors: Any) -> int:
    """Bytes of a tensor, or of a (nested) list of tensors."""
    # On every collective's path: exact type checks (a union isinstance costs ~0.3 µs), a
    # loop rather than a generator, and no call per tensor.
    kind = type(tensors)
    if kind is list or kind is tuple:
        total = 0
        for item in tensors:
            total += item.nbytes if isinstance(item, _Tensor) else tensors_bytes(item)
        return total
    if isinstance(tensors, _Tensor):
        return int(tensors.nbytes)
    return 0
