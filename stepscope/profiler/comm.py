"""Collective timing: DDP's gradient all-reduce and wrappers around torch.distributed collectives.

DDP is timed at one of two levels (Config.comm_timing):

- "step" (`DdpStepTimer`): DDP runs untouched (no comm hook); two autograd-engine callbacks
  per step stamp when this rank's backward finished computing (its last bucket is ready)
  and when every bucket is reduced. That gives comm_wait_s, in three Python calls a step.
- "bucket" (`make_ddp_hook`): a comm hook wrapping DDP's all-reduce stamps each bucket's
  ready and completion times, adding the in-flight time and per-bucket busy time, at a cost
  of a Python call and a future callback per bucket.

Both, and the collective wrappers, produce `CollectiveCall`s: when the data was ready, when
the collective completed, how many bytes, and whether the rank was blocked for the whole
duration. Recording never changes what the collective does, and a failure to record never
stops the collective from running.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from .timer import Clock, Mark

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CollectiveCall:
    """One collective as this rank saw it."""

    op: str
    """One of schema.COLLECTIVE_OPS."""
    group_size: int
    num_bytes: int
    """Payload per rank, nccl-tests convention (all_gather: the gathered output)."""
    start: Mark
    end: Mark | None = None
    """None until the collective completed."""
    blocking: bool = False
    """The caller sat blocked from start to end (a synchronous call)."""
    ddp_bucket: bool = False
    """DDP gradients: start is when they were ready (a bucket, or the last bucket of a step)."""
    count: int = 1
    """Collectives this call stands for (DdpStepTimer: the step's buckets)."""


Record = Callable[[CollectiveCall], None]


def tensor_bytes(tensor: Any) -> int:
    """Bytes of a tensor (0 for anything else)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.numel() * tensor.element_size()
    return 0


def tensors_bytes(tensors: Any) -> int:
    """Bytes of a list of tensors."""
    if isinstance(tensors, list | tuple):
        return sum(tensor_bytes(t) for t in tensors)
    return tensor_bytes(tensors)


def group_size_of(group: Any) -> int:
    """Ranks in `group` (the default group when None)."""
    try:
        return int(dist.get_world_size(group))
    except Exception:  # not a member, or not initialised
        return 0


def make_ddp_hook(*, clock: Clock, record: Record) -> Callable[..., Any]:
    """A DDP comm hook doing what DDP does without one, timing each bucket.

    It scales the bucket by 1/world size and all-reduces it (sum) through the process
    group's own C++ `allreduce`, as DDP's built-in path does: `dist.all_reduce` would add
    Python overhead per bucket, and pass through stepscope's wrapper of it (timing the
    bucket twice). Multiplying by the reciprocal is DDP's own hook-less arithmetic
    (bit-identical gradients) and runs about twice as fast as a division on CPU. One future
    callback per bucket stamps its completion.
    """
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    opts.asyncOp = True
    group_sizes: dict[int, int] = {}
    mark = clock.mark

    def hook(process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        group: Any = process_group if process_group is not None else dist.group.WORLD
        size = group_sizes.get(id(group))
        if size is None:
            size = group_sizes[id(group)] = group_size_of(group)
        tensor = bucket.buffer()
        call: CollectiveCall | None
        try:
            call = CollectiveCall(
                op="all_reduce",
                group_size=size,
                num_bytes=tensor.numel() * tensor.element_size(),
                start=mark(),
                ddp_bucket=True,
            )
            record(call)
        except Exception:
            log.debug("stepscope could not time a DDP bucket", exc_info=True)
            call = None
        if size > 1:
            tensor.mul_(1.0 / size)
        # Gloo and NCCL reduce complex tensors as pairs of reals, as dist.all_reduce does.
        data = torch.view_as_real(tensor) if tensor.is_complex() else tensor
        future = group.allreduce([data], opts).get_future()
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

    def __init__(self, ddp: Any, *, clock: Clock, record: Record) -> None:
        self._ddp = ddp
        self._mark = clock.mark
        self._record = record
        self._group_size = group_size_of(ddp.process_group)
        module_params = getattr(ddp, "_module_parameters", None) or ddp.parameters()
        params = [p for p in module_params if p.requires_grad]
        self._num_bytes = sum(tensor_bytes(p) for p in params)
        self._num_buckets = _bucket_count(ddp, params)
        self._armed = True
        self._compute_done: Mark | None = None
        # Two parameters, in case one is unused in a step: the first hook to fire times it.
        watched = {id(p): p for p in (params[0], params[-1])} if params else {}
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
        try:
            self._record(
                CollectiveCall(
                    op="all_reduce",
                    group_size=self._group_size,
                    num_bytes=self._num_bytes,
                    start=start,
                    end=self._mark(),
                    ddp_bucket=True,
                    count=self._num_buckets,
                )
            )
        except Exception:
            log.debug("stepscope could not time a DDP step", exc_info=True)


def _bucket_count(ddp: Any, params: list[torch.Tensor]) -> int:
    """How many buckets DDP all-reduces a step (its bucket caps over the gradients, last first)."""
    try:
        limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, int(ddp.bucket_bytes_cap)]
        buckets, _ = dist._compute_bucket_assignment_by_size(list(reversed(params)), limits)
        return max(1, len(buckets))
    except Exception:  # a private helper: without it, one all-reduce per step is assumed
        return 1


@dataclass(frozen=True, slots=True)
class _Spec:
    op: str
    data_pos: int | None
    data_name: str | None
    group_pos: int
    async_pos: int | None
    """Position of async_op; None for calls that are always sync (send/recv)."""


SPECS: dict[str, _Spec] = {
    "all_reduce": _Spec("all_reduce", 0, "tensor", 2, 3),
    "all_gather": _Spec("all_gather", 0, "tensor_list", 2, 3),
    "all_gather_into_tensor": _Spec("all_gather", 0, "output_tensor", 2, 3),
    "all_gather_single": _Spec("all_gather", 0, "output_tensor", 2, 3),
    "reduce_scatter": _Spec("reduce_scatter", 1, "input_list", 3, 4),
    "reduce_scatter_tensor": _Spec("reduce_scatter", 1, "input", 3, 4),
    "reduce_scatter_single": _Spec("reduce_scatter", 1, "input", 3, 4),
    "broadcast": _Spec("broadcast", 0, "tensor", 2, 3),
    "reduce": _Spec("reduce", 0, "tensor", 3, 4),
    "all_to_all": _Spec("all_to_all", 1, "input_tensor_list", 2, 3),
    "all_to_all_single": _Spec("all_to_all", 1, "input", 4, 5),
    "barrier": _Spec("barrier", None, None, 0, 1),
    "send": _Spec("send", 0, "tensor", 2, None),
    "recv": _Spec("recv", 0, "tensor", 2, None),
}
"""The torch.distributed functions timed, with where their arguments are.

Not `isend`/`irecv`: `dist.P2POp` (torch.distributed.pipelining, batch_isend_irecv) checks its
op's identity against them, and a wrapper fails that check on every rank."""


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int | None, name: str | None) -> Any:
    if pos is not None and pos < len(args):
        return args[pos]
    return kwargs.get(name) if name is not None else None


class CollectivePatch:
    """Wraps torch.distributed collectives while installed; `remove()` puts the originals back."""

    def __init__(self, *, clock: Clock, record: Record) -> None:
        self._clock = clock
        self._record = record
        self._originals: dict[str, Callable[..., Any]] = {}
        self._local = threading.local()
        self.enabled = True

    def install(self) -> None:
        for name, spec in SPECS.items():
            fn = getattr(dist, name, None)
            if fn is None or name in self._originals:
                continue
            self._originals[name] = fn
            setattr(dist, name, self._wrap(fn, spec))

    def remove(self) -> None:
        for name, fn in self._originals.items():
            current = getattr(dist, name, None)
            if getattr(current, "__stepscope_wrapped__", None) is fn:
                setattr(dist, name, fn)
        self._originals.clear()

    def _wrap(self, fn: Callable[..., Any], spec: _Spec) -> Callable[..., Any]:
        local = self._local

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # While torch.compile traces the caller, the wrapper steps aside: dynamo turns the
            # collective into a functional one, and a clock read here would break the graph.
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            if not self.enabled or getattr(local, "inside", False):
                return fn(*args, **kwargs)
            call = self._begin(spec, args, kwargs)
            local.inside = True
            try:
                result = fn(*args, **kwargs)
            finally:
                local.inside = False
            if call is not None:
                self._end(call, result)
            return result

        wrapper.__name__ = getattr(fn, "__name__", spec.op)
        wrapper.__doc__ = fn.__doc__
        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__stepscope_wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def _begin(
        self, spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> CollectiveCall | None:
        try:
            group = _arg(args, kwargs, spec.group_pos, "group")
            if spec.async_pos is None:
                is_async = False
            else:
                is_async = bool(_arg(args, kwargs, spec.async_pos, "async_op"))
            data = _arg(args, kwargs, spec.data_pos, spec.data_name)
            call = CollectiveCall(
                op=spec.op,
                group_size=group_size_of(group),
                num_bytes=tensors_bytes(data),
                start=self._clock.mark(),
                blocking=not is_async,
            )
            self._record(call)
            return call
        except Exception:
            log.debug("stepscope could not time a collective", exc_info=True)
            return None

    def _end(self, call: CollectiveCall, result: Any) -> None:
        clock = self._clock
        try:
            if call.blocking or result is None:
                call.end = clock.mark()
                return

            def done(_: Any) -> None:
                try:
                    call.end = clock.mark()
                except Exception:
                    log.debug("stepscope could not time a collective", exc_info=True)

            try:
                result.get_future().add_done_callback(done)
            except Exception:  # a backend without futures: completion unknown, use return time
                call.end = clock.mark()
        except Exception:
            log.debug("stepscope could not time a collective", exc_info=True)
