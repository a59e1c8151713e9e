"""The collective tap: every collective this process issues, per process group, at a few µs each.

Two layers, which never see the same call twice:

- Class-level wrappers on `torch._C._distributed_c10d.ProcessGroup` methods see every
  collective issued from Python: `torch.distributed.*`, FSDP1 and FSDP2, pipeline send/recv,
  async work, DDP comm hooks. A class-level `Work.wait` wrapper measures the exposed wait,
  the time the caller sat blocked, and stamps the completion of work waited at once (every
  synchronous call). On the CPU clock, work that is still unwaited at the next collective,
  section or step boundary is looked at there (`observe()`): completed, it ends there; in
  flight, its future's callback (on the backend's thread) stamps its end. So only work that
  overlaps the caller's own pays for a callback (~5 µs). On a device clock every async
  work's future gets the callback.
- Python kernels on the `BackendSelect` dispatch key of the `_c10d_functional` ops see the
  functional collectives that DTensor, tensor parallelism and compiled graphs issue (they
  reach the process group in C++); `wait_tensor`'s kernel measures their exposed wait.

DDP's reducer issues its all-reduces in C++ and is timed by comm.DdpStepTimer or the
comm hook instead. Nothing the user observes changes: arguments, return values, exceptions
and identities pass through (`dist.isend` is untouched, so `P2POp` still recognises it), and
every wrapper steps aside while the compiler traces. An error inside the tap turns it off,
is reported once through `on_error`, and the collective runs as if the tap were not there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroup, Work

from stepscope.profiler.collectives.calls import CollectiveCall, tensors_bytes
from stepscope.profiler.collectives.groups import GroupInfo, GroupRegistry
from stepscope.profiler.timer import Clock, Mark

log = logging.getLogger(__name__)

PG_METHODS: dict[str, tuple[str, int | None]] = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "reduce": ("reduce", 0),
    "allgather": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "_allgather_base": ("all_gather", 0),
    "allgather_coalesced": ("all_gather", 0),
    "all_gather_single_coalesced": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "alltoall": ("all_to_all", 1),
    "alltoall_base": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 1),
    "send": ("send", 0),
    "recv": ("recv", 0),
    "recv_anysource": ("recv", 0),
    "barrier": ("barrier", None),
}
"""ProcessGroup method → (op, position of the argument whose bytes are the payload).

Payload by the nccl-tests conventions: all_gather counts the gathered output,
reduce_scatter and all_to_all the input."""

FUNCOL_OPS: dict[str, tuple[str, int]] = {
    "all_reduce": ("all_reduce", 2),
    "all_reduce_": ("all_reduce", 2),
    "all_reduce_coalesced": ("all_reduce", 2),
    "all_reduce_coalesced_": ("all_reduce", 2),
    "all_gather_into_tensor": ("all_gather", 2),
    "all_gather_into_tensor_out": ("all_gather", 2),
    "all_gather_into_tensor_coalesced": ("all_gather", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 3),
    "reduce_scatter_tensor_out": ("reduce_scatter", 3),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 3),
    "all_to_all_single": ("all_to_all", 3),
    "broadcast": ("broadcast", 2),
    "broadcast_": ("broadcast", 2),
    "isend": ("send", 3),
    "irecv": ("recv", 3),
}
"""_c10d_functional op → (op, position of its group argument). Their payload is the input,
but all_gather's, which is its output (group size × input)."""

_P2P = frozenset({"send", "recv"})
_MAX_PENDING = 4096
"""Functional collectives whose wait_tensor is still to come; beyond it the oldest go."""
_MAX_PENDING_WORK = 256
"""Works looked at (observe()) whose wait is still to come. Held strongly (a weak map costs
~1 µs a call), so a work its caller drops without waiting stays until 256 newer ones push it
out."""

_Tensor = torch.Tensor
_AFTER_BACKEND_SELECT = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
_META = torch._C.DispatchKey.Meta
_meta_in_tls = torch._C._meta_in_tls_dispatch_include
_installed: CollectiveTap | None = None


def untapped(name: str) -> Any:
    """ProcessGroup's own method `name`, even while a tap wraps it (for DDP's comm hook,
    which times its buckets itself)."""
    if _installed is not None:
        original = _installed._originals.get((ProcessGroup, name))
        if original is not None:
            return original
    return ProcessGroup.__dict__[name]


class CollectiveTap:
    """Records every collective as a `CollectiveCall` while installed (one per process)."""

    def __init__(
        self,
        *,
        clock: Clock,
        calls: list[CollectiveCall],
        groups: GroupRegistry,
        on_error: Callable[[BaseException], None] | None = None,
        max_calls: int = 10_000,
    ) -> None:
        self.calls = calls
        """Where recorded calls go; the owner takes them (at each step's end)."""
        self.max_calls = max_calls
        """Beyond it calls are not recorded (nobody takes them: no steps)."""
        self.groups = groups
        self._on_error = on_error
        self.enabled = False
        self._originals: dict[tuple[type, str], Any] = {}
        self._library: Any = None
        self._pending_work: dict[Any, CollectiveCall] = {}
        self._pending_tensors: dict[int, CollectiveCall] = {}
        """Functional collectives by the data_ptr() of their result tensor(s), until its
        wait_tensor. Not by id(): the object wait_tensor gets is not always the one the op
        returned (tensor parallelism's, under autograd)."""
        self.unobserved: list[tuple[Any, CollectiveCall]] = []
        """Works issued on the CPU clock and not yet looked at (observe()) or waited; the
        same list for the tap's life."""
        self.waiting: CollectiveCall | None = None
        """The collective the training thread is blocked in now (for the hang watchdog)."""
        self.clock = clock

    @property
    def clock(self) -> Clock:
        """Replaceable: the profiler moves to CUDA events once it sees the device."""
        return self._clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self._clock = clock
        self._mark = clock.mark
        self._on_cpu = clock.name == "cpu"

    # ---- lifecycle ------------------------------------------------------------------------

    def install(self) -> None:
        """Wrap the process-group methods and register the functional-collective kernels."""
        global _installed
        if _installed is not None:
            _installed.remove()
        for name, (op, position) in PG_METHODS.items():
            original = ProcessGroup.__dict__.get(name)
            if original is not None:
                self._originals[(ProcessGroup, name)] = original
                setattr(ProcessGroup, name, self._pg_wrapper(original, name, op, position))
        original_wait = Work.__dict__["wait"]
        self._originals[(Work, "wait")] = original_wait
        setattr(Work, "wait", self._wait_wrapper(original_wait))  # noqa: B010
        self._register_kernels()
        self.enabled = True
        _installed = self

    def remove(self) -> None:
        """Put the originals back and unregister the kernels."""
        global _installed
        self.enabled = False
        for (cls, name), original in self._originals.items():
            setattr(cls, name, original)
        self._originals.clear()
        if self._library is not None:
            self._library._destroy()
            self._library = None
        self._pending_tensors.clear()
        self._pending_work.clear()
        self.unobserved.clear()
        if _installed is self:
            _installed = None

    def _fail(self, exc: BaseException) -> None:
        """Turn recording off after an internal error; the collectives run on untouched."""
        if not self.enabled:
            return
        self.enabled = False
        log.warning("stepscope: the collective tap failed and is off: %r", exc, exc_info=exc)
        if self._on_error is not None:
            try:
                self._on_error(exc)
            except Exception:
                log.debug("stepscope: on_error raised", exc_info=True)

    # ---- process-group layer --------------------------------------------------------------

    def _pg_wrapper(
        self, original: Any, name: str, op: str, position: int | None
    ) -> Callable[..., Any]:
        tap = self
        is_compiling = torch.compiler.is_compiling
        by_id = self.groups.by_id
        sequenced = op not in _P2P
        at = -1 if position is None else position

        # Every collective's path: one frame, no Python call but the bytes of a list.
        def wrapper(pg: Any, *args: Any, **kwargs: Any) -> Any:
            if not tap.enabled or is_compiling():
                return original(pg, *args, **kwargs)
            try:
                if tap.unobserved:
                    tap.observe()
                entry = by_id.get(id(pg))
                group = entry[1] if entry is not None and entry[0] is pg else tap.groups.of(pg)
                on_cpu = tap._on_cpu
                if on_cpu or not tap._capturing():
                    seq = None
                    if sequenced:
                        seq = group.seq = group.seq + 1
                    payload = args[at] if 0 <= at < len(args) else None
                    num_bytes = (
                        payload.nbytes if type(payload) is _Tensor else tensors_bytes(payload)
                    )
                    # Positional: keywords cost ~0.5 µs here.
                    call = CollectiveCall(op, group, num_bytes, tap._mark(), None, seq)
                    if seq is None:
                        _number_on_channel(tap.groups, call, args)
                    calls = tap.calls
                    if len(calls) < tap.max_calls:
                        calls.append(call)
                else:
                    call = None
            except Exception as exc:
                tap._fail(exc)
                return original(pg, *args, **kwargs)
            work = original(pg, *args, **kwargs)
            if call is not None:
                try:
                    if work is None:
                        call.end = tap._mark()
                    elif on_cpu:
                        # No callback (~5 µs): most work is waited at once (synchronous
                        # calls always), and its wait stamps its end. The next collective,
                        # section or step looks at work still unwaited (observe()).
                        tap.unobserved.append((work, call))
                    else:
                        tap._hold(work, call)
                        if not args or getattr(args[-1], "asyncOp", True) is not False:
                            tap._arm(call, work)
                except Exception as exc:
                    tap._fail(exc)
            return work

        wrapper.__name__ = name
        wrapper.__qualname__ = f"ProcessGroup.{name}"
        wrapper.__doc__ = getattr(original, "__doc__", None)
        return wrapper

    def _group(self, group: Any) -> GroupInfo | None:
        """The group of a ProcessGroup, or of a functional collective's group argument (its
        name, or a boxed ProcessGroup)."""
        try:
            if isinstance(group, str):
                return self.groups.named(group)
            if not isinstance(group, ProcessGroup):
                group = ProcessGroup.unbox(group)
            return self.groups.of(group)
        except Exception as exc:
            self._fail(exc)
            return None

    def _capturing(self) -> bool:
        """A CUDA graph is being captured: its replays run no Python, so record none of it."""
        return self._clock.name == "cuda" and torch.cuda.is_current_stream_capturing()

    def _arm(self, call: CollectiveCall, work: Any) -> None:
        """Stamp the call's end when its work's future completes (on the backend's thread)."""
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's reduce_scatter_single: completion = end of its wait
            return
        future.add_done_callback(functools.partial(_completed, self._clock, call))

    def _hold(self, work: Any, call: CollectiveCall) -> None:
        """Keep the call of a work whose wait is still to come (the oldest go past a bound)."""
        pending = self._pending_work
        if len(pending) >= _MAX_PENDING_WORK:
            pending.pop(next(iter(pending)))
        pending[work] = call

    def observe(self) -> None:
        """Look at the works issued and not waited since the last look: completed ones end
        now; those still in flight get a completion callback (their transfer overlaps the
        caller's own work)."""
        unobserved = self.unobserved.copy()
        self.unobserved.clear()  # the same list for the tap's life: the profiler holds it
        try:
            for work, call in unobserved:
                self._hold(work, call)
                if call.end is not None:
                    continue
                if work.is_completed():
                    call.end = self._mark()
                    _completed_seq(call)
                else:
                    self._arm(call, work)
        except Exception as exc:
            self._fail(exc)

    def _wait_wrapper(self, original: Any) -> Callable[..., Any]:
        tap = self

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if not tap.enabled:
                return original(work, *args, **kwargs)
            try:
                call = None
                unobserved = tap.unobserved
                if unobserved:
                    if unobserved[-1][0] is work:  # issued, then waited: the usual case
                        call = unobserved.pop()[1]
                    else:
                        for index, (issued, issued_call) in enumerate(unobserved):
                            if issued is work:
                                call = issued_call
                                del unobserved[index]
                                break
                if call is None and tap._pending_work:
                    call = tap._pending_work.pop(work, None)
                if call is not None:
                    start = tap._mark()
                    tap.waiting = call
            except Exception as exc:
                tap._fail(exc)
                call = None
            if call is None:
                return original(work, *args, **kwargs)
            try:
                return original(work, *args, **kwargs)
            finally:
                tap._waited(call, start)

        wait.__name__ = "wait"
        wait.__qualname__ = "Work.wait"
        wait.__doc__ = getattr(original, "__doc__", None)
        return wait

    def _waited(self, call: CollectiveCall, start: Mark) -> None:
        """The training thread is back from waiting for `call` since `start`."""
        self.waiting = None
        try:
            end = self._mark()
            if self._on_cpu:
                call.wait_s += end - start
            elif call.waits is None:
                call.waits = [(start, end)]
            else:
                call.waits.append((start, end))
            if call.end is None:
                call.end = end
                _completed_seq(call)
            elif self._on_cpu and start <= call.end < end:
                # Completed while this thread sat in the wait: it was busy until the
                # thread resumed (the backend's thread stamped it earlier).
                call.end = end
        except Exception as exc:
            self._fail(exc)

    # ---- functional-collective layer ------------------------------------------------------

    def _register_kernels(self) -> None:
        namespace = torch.ops._c10d_functional
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
        library = torch.library.Library("_c10d_functional", "IMPL")
        for name, (op, group_position) in FUNCOL_OPS.items():
            packet = getattr(namespace, name, None)
            if packet is None or has_kernel(f"_c10d_functional::{name}", "BackendSelect"):
                continue
            kernel = self._funcol_kernel(packet.default, op, group_position)
            library.impl(name, kernel, "BackendSelect")
        if not has_kernel("_c10d_functional::wait_tensor", "BackendSelect"):
            wait = torch.ops._c10d_functional.wait_tensor.default
            library.impl("wait_tensor", self._wait_kernel(wait), "BackendSelect")
        self._library = library

    def _funcol_kernel(self, overload: Any, op: str, group_position: int) -> Callable[..., Any]:
        tap = self
        redispatch = overload._handle.redispatch_boxed  # OpOverload.redispatch, less a frame
        named = self.groups.by_name
        gathers = op == "all_gather"
        sequenced = op not in _P2P

        def kernel(*args: Any, **kwargs: Any) -> Any:
            first = args[0]
            # The keys below BackendSelect: those of a plain CPU or CUDA tensor inline (see
            # keys_below_backend_select), any other argument's from the dispatcher's rule.
            if type(first) is _Tensor and not _meta_in_tls():
                keys = _CPU if first.is_cpu else _CUDA if first.is_cuda else None
                plain = True
            else:
                keys = None
                plain = type(first) is list and bool(first) and type(first[0]) is _Tensor
            if keys is None:
                keys = keys_below_backend_select(args, kwargs)
                plain = plain and not keys.has(_META)
            if not tap.enabled or not plain:  # FakeTensors while tracing
                return redispatch(keys, *args, **kwargs)
            name = args[group_position]  # a group's name, or a boxed ProcessGroup
            group = (named.get(name) if type(name) is str else None) or tap._group(name)
            call = None
            if group is not None and (tap._on_cpu or not tap._capturing()):
                try:
                    seq = None
                    if sequenced:
                        seq = group.seq = group.seq + 1
                    num_bytes = 0
                    if not gathers:  # all_gather's payload is its output
                        num_bytes = first.nbytes if type(first) is _Tensor else tensors_bytes(first)
                    call = CollectiveCall(op, group, num_bytes, tap._mark(), None, seq)
                    calls = tap.calls
                    if len(calls) < tap.max_calls:
                        calls.append(call)
                except Exception as exc:
                    tap._fail(exc)
                    call = None
            result = redispatch(keys, *args, **kwargs)
            if call is not None:
                try:
                    if gathers:
                        call.num_bytes = tensors_bytes(result)
                    pending = tap._pending_tensors
                    if len(pending) >= _MAX_PENDING:
                        pending.pop(next(iter(pending)))
                    if type(result) is _Tensor:
                        pending[result.data_ptr()] = call
                    else:
                        for tensor in result:
                            pending[tensor.data_ptr()] = call
                except Exception as exc:
                    tap._fail(exc)
            return result

        return kernel

    def _wait_kernel(self, overload: Any) -> Callable[..., Any]:
        tap = self
        redispatch = overload._handle.redispatch_boxed
        pending = self._pending_tensors

        def wait_tensor(tensor: Any) -> Any:
            if type(tensor) is _Tensor and not _meta_in_tls():
                keys = _CPU if tensor.is_cpu else _CUDA if tensor.is_cuda else None
                plain = True
            else:
                keys = None
                plain = False  # FakeTensors while tracing
            if keys is None:
                keys = keys_below_backend_select((tensor,), {})
                plain = plain and not keys.has(_META)
            if not tap.enabled or not pending or not plain:
                return redispatch(keys, tensor)
            try:
                call = pending.pop(tensor.data_ptr(), None)
                if call is not None:
                    start = tap._mark()
                    tap.waiting = call
            except Exception as exc:
                tap._fail(exc)
                call = None
            if call is None:
                return redispatch(keys, tensor)
            try:
                return redispatch(keys, tensor)
            finally:
                tap._waited(call, start)

        return wait_tensor


def keys_below_backend_select(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The dispatch keys a kernel on BackendSelect redispatches to for these arguments.

    The dispatcher's own rule (c10's computeDispatchKeySet): the keys of every tensor
    argument, with the thread's included keys and less its excluded ones, below
    BackendSelect. The kernels take the keys of a plain CPU or CUDA tensor (with no Meta
    key included, which FakeTensors' kernels include) inline instead, `CPU` or `CUDA`: ~0.5 µs
    less a kernel than being handed the dispatcher's key set, where a call of this function
    would cost ~0.1 µs. A sparse or quantized CPU tensor's own keys would reach the same
    kernel: these ops have one for every backend but Meta (CompositeExplicitAutograd).
    """
    keys = torch._C._dispatch_tls_local_include_set()
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, torch.Tensor):
                keys = keys | torch._C._dispatch_keys(item)
    return (keys - torch._C._dispatch_tls_local_exclude_set()) & _AFTER_BACKEND_SELECT


def _number_on_channel(groups: GroupRegistry, call: CollectiveCall, args: tuple[Any, ...]) -> None:
    """A send or recv's channel and sequence number on it (send/recv only: a peer is named by
    its group rank, args[1]; recv_anysource names none), for the hang watchdog."""
    peer = args[1] if len(args) > 1 else None
    if type(peer) is not int:
        return
    channel = groups.channel(call.group, call.op, peer)
    if channel is not None:
        channel.seq += 1
        call.channel, call.channel_seq = channel, channel.seq


def _completed_seq(call: CollectiveCall) -> None:
    if call.seq is not None and call.seq > call.group.completed_seq:
        call.group.completed_seq = call.seq
    elif call.channel is not None and call.channel_seq > call.channel.completed_seq:
        call.channel.completed_seq = call.channel_seq


def _completed(clock: Clock, call: CollectiveCall, _: Any) -> None:
    """A work's future completed (on the backend's thread): stamp the collective's end."""
    try:
        if call.end is None:
            call.end = clock.mark()
            _completed_seq(call)
    except Exception:
        log.debug("stepscope could not time a collective", exc_info=True)
