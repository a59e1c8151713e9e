"""DDP's gradient all-reduce, which its C++ reducer issues where the collective tap cannot see it.

DDP is timed at one of two levels (Config.comm_timing):

- "step" (`DdpStepTimer`): DDP runs untouched (no comm hook); two autograd-engine callbacks
  per step stamp when this rank's backward finished computing (its last bucket is ready)
  and when every bucket is reduced. That gives comm_wait_s, in three Python calls a step.
- "bucket" (`make_ddp_hook`): a comm hook wrapping DDP's all-reduce stamps each bucket's
  ready and completion times, adding the in-flight time and per-bucket busy time, at a cost
  of a Python call and a future callback per bucket.

Both produce `CollectiveCall`s in DDP's process group. Recording never changes what the
collective does, and a failure to record never stops the collective from running.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from stepscope.profiler.collectives.calls import CollectiveCall, Record, tensor_bytes
from stepscope.profiler.collectives.groups import GroupRegistry
from stepscope.profiler.timer import Clock, Mark

log = logging.getLogger(__name__)


OnError = Callable[[BaseException], None]


def make_ddp_hook(
    *, clock: Clock, record: Record, groups: GroupRegistry, on_error: OnError | None = None
) -> Callable[..., Any]:
    """A DDP comm hook doing what DDP does without one, timing each bucket.

    It scales the bucket by 1/world size and all-reduces it (sum) through the process
    group's own C++ `allreduce` (not the tap's wrapper of it, which would time the bucket
    twice), as DDP's built-in path does. Multiplying by the reciprocal is DDP's own
    hook-less arithmetic (bit-identical gradients) and runs about twice as fast as a
    division on CPU. One future callback per bucket stamps its completion.
    """
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    opts.asyncOp = True
    mark = clock.mark
    from stepscope.profiler.collectives.tap import untapped

    allreduce = untapped("allreduce")

    failure = _Failure(on_error)
    sizes: dict[int, int] = {}

    def hook(process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        group: Any = process_group if process_group is not None else dist.group.WORLD
        tensor = bucket.buffer()
        call: CollectiveCall | None = None
        size = sizes.get(id(group))
        if not failure.failed:
            try:
                info = groups.of(group)
                size = sizes[id(group)] = info.size
                info.seq += 1
                call = CollectiveCall(
                    op="all_reduce",
                    group=info,
                    num_bytes=tensor.numel() * tensor.element_size(),
                    start=mark(),
                    seq=info.seq,
                    ddp_bucket=True,
                )
                record(call)
            except Exception as exc:
                failure.report(exc)
                call = None
        if size is None:
            size = sizes[id(group)] = group.size()
        if size > 1:
            tensor.mul_(1.0 / size)
        # Gloo and NCCL reduce complex tensors as pairs of reals, as dist.all_reduce does.
        data = torch.view_as_real(tensor) if tensor.is_complex() else tensor
        future = allreduce(group, [data], opts).get_future()
        return future.then(functools.partial(_bucket_done, call, mark, tensor))

    # DDP checks these annotations; with postponed evaluation they would be strings.
    hook.__annotations__ = {
        "process_group": Any,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


def _bucket_done(
    call: CollectiveCall | None,
    mark: Callable[[], Mark],
    tensor: torch.Tensor,
    future: torch.futures.Future[Any],
) -> torch.Tensor:
    """Stamp a bucket's completion; return the reduced bucket (re-raising a failed collective)."""
    future.value()
    if call is not None:
        try:
            call.end = mark()
        except Exception:
            log.debug("stepscope could not time a DDP bucket", exc_info=True)
    return tensor


class DdpStepTimer:
    """Times a DDP model's gradient all-reduce once per step, without a comm hook.

    A post-accumulate-grad hook on a parameter runs during backward, before DDP's own hook
    on that parameter (so before DDP can have found its last bucket ready), and queues an
    autograd-engine callback. Callbacks run when the backward pass has finished, in the
    order queued: ours runs before the one DDP queues (when its last bucket becomes ready)
    to wait for the all-reduces and write the gradients, stamping the end of this rank's
    gradient compute; it queues a second one, which runs after DDP's and stamps the
    reduced gradients. The step's `CollectiveCall` spans the two: this rank's exposed
    all-reduce time (comm_wait_s). How long the all-reduces were in flight behind backward
    is not seen at this level. A backward whose forward did not prepare DDP to reduce
    (`no_sync()`, or an evaluation forward in between) is not timed.

    The hook is handed the parameter, not its gradient, and touches neither. On CUDA the
    engine runs its callbacks on the streams current when backward() was called, synced
    with the gradients' streams, so the two event marks are the device-side times. The
    bucket count is estimated from DDP's bucket caps.
    """

    def __init__(
        self,
        ddp: Any,
        *,
        clock: Clock,
        record: Record,
        groups: GroupRegistry,
        on_error: OnError | None = None,
    ) -> None:
        self._ddp = ddp
        self._failure = _Failure(on_error)
        self._mark = clock.mark
        self._record = record
        self._group = groups.of(ddp.process_group)
        module_params = getattr(ddp, "_module_parameters", None) or ddp.parameters()
        params = [p for p in module_params if p.requires_grad]
        self._num_bytes = sum(tensor_bytes(p) for p in params)
        self._num_buckets = _bucket_count(ddp, params)
        self._armed = True
        self._compute_done: Mark | None = None
        # One parameter where DDP requires every one to get a gradient in every step; else
        # two, in case one is unused in a step: the first hook to fire times it (each hook is
        # a call into Python from the autograd engine, every step).
        may_skip = getattr(ddp, "find_unused_parameters", True) or getattr(
            ddp, "static_graph", True
        )
        ends = params[:1] + params[-1:] if may_skip else params[:1]
        watched = {id(p): p for p in ends}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._gradient_arrived) for p in watched.values()
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _gradient_arrived(self, param: torch.Tensor) -> None:
        if self._armed and self._ddp.require_forward_param_sync:
            self._armed = False
            Variable._execution_engine.queue_callback(self._gradients_computed)

    def _gradients_computed(self) -> None:
        self._armed = True  # every hook of this backward has run: ready for the next one
        self._compute_done = self._mark()
        Variable._execution_engine.queue_callback(self._gradients_reduced)

    def _gradients_reduced(self) -> None:
        start, self._compute_done = self._compute_done, None
        if self._failure.failed:  # the attribute: a __bool__ would cost a frame each step
            return
        try:
            group = self._group
            group.seq += 1  # one a synchronising backward, on every rank alike
            # op, group, num_bytes, start, end, seq, waits, ddp_bucket, count: positional
            # (keywords cost ~0.5 µs, every step).
            end = self._mark()
            self._record(
                CollectiveCall(
                    "all_reduce", group, self._num_bytes, start, end, group.seq, None, True,
                    self._num_buckets,
                )
            )  # fmt: skip
        except Exception as exc:
            self._failure.report(exc)


class _Failure:
    """A DDP timer's error: logged and reported once, after which it times nothing."""

    __slots__ = ("_on_error", "failed")

    def __init__(self, on_error: OnError | None) -> None:
        self._on_error = on_error
        self.failed = False

    def report(self, exc: BaseException) -> None:
        self.failed = True
        log.warning("stepscope: DDP timing failed and is off: %r", exc, exc_info=exc)
        if self._on_error is not None:
            try:
                self._on_error(exc)
            except Exception:
                log.debug("stepscope: on_error raised", exc_info=True)


def _bucket_count(ddp: Any, params: list[torch.Tensor]) -> int:
    """How many buckets DDP all-reduces a step (its bucket caps over the gradients, last first)."""
    try:
        limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, int(ddp.bucket_bytes_cap)]
        buckets, _ = dist._compute_bucket_assignment_by_size(list(reversed(params)), limits)
        return max(1, len(buckets))
    except Exception:  # a private helper: without it, one all-reduce per step is assumed
        return 1
