"""Zero-code's hooks on torch: what they observe, and when zero-code's profiler starts.

Per process: `install()` waits for torch's import; from then on, building an optimizer,
wrapping a model in DDP, the first data-loader batch or the first backward starts the
profiler (`activate()`), except in the torchrun agent, in DataLoader workers and where the
script started profiling itself. While zero-code owns the steps, the loop's signals go to
`StepInference`:
- data waits: `_BaseDataLoaderIter.__next__` (torch's iterators and torchdata's
  StatefulDataLoader, which calls it);
- forwards of root modules (found with global module hooks during the first steps, then
  timed on the roots alone, so the other modules keep nn.Module's fast path: a root's call
  goes through zero-code's `_compiled_call_impl`, or its own hooks where that cannot be);
- backward: torch.autograd's `_engine_run_backward`;
- optimizer updates: the global optimizer step hooks and `GradScaler.step`.
No hook acts inside a compiled region or during CUDA graph capture, or off the training thread.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from threading import get_ident
from types import ModuleType
from typing import Any

from stepscope.profiler import session
from stepscope.profiler.auto import passive
from stepscope.profiler.auto.imports import when_imported
from stepscope.profiler.auto.patches import Patches
from stepscope.profiler.auto.steps import StepInference
from stepscope.profiler.base import Profiler

log = logging.getLogger(__name__)

DISCOVERY_STEPS = 2
"""Steps during which global module hooks look for the root modules (those called at depth 0)."""


class ZeroCode:
    """This process's zero-code state: waiting, active (owns the steps), passive or off."""

    def __init__(self) -> None:
        self.state = "waiting"
        self.inference: StepInference | None = None
        """Set while zero-code owns the steps: the hooks' one check."""
        self.has_optimizer = False
        self.profiler: Profiler | None = None
        self.patches = Patches()
        self._module_hooks = Patches()
        self._roots: dict[int, Any] = {}
        self._roots_found = False
        """The roots are timed on their own (discovery ended); the global hooks are gone."""
        self._depth = 0
        self._timed: list[bool] = []
        """Per root forward in progress: whether it is timed as a section."""
        self._grad_enabled: Callable[[], bool] = _never
        self._thread_id = threading.get_ident()
        self._pid = os.getpid()
        self._is_compiling: Callable[[], bool] = _never
        self._unobservable: Callable[[], bool] = _never
        """In a compiled region, or while the current CUDA stream captures a graph."""

    # ---- lifecycle -------------------------------------------------------------------------

    def activate(self) -> None:
        """Start profiling this process, unless it must stay unprofiled."""
        if self.state != "waiting":
            return
        self.state = "off"
        try:
            self._start()
        except Exception:
            log.warning("stepscope: zero-code profiling is off after an error", exc_info=True)

    def _start(self) -> None:
        if os.getpid() != self._pid or _in_worker_or_agent():
            return
        running = session.current()
        if running is not None:  # the script (or an adapter) profiles itself: step aside
            self.state = "passive"
            return
        from stepscope.profiler.setup import build_profiler

        profiler = build_profiler()
        if not profiler.enabled:
            return
        self.profiler = profiler
        self._thread_id = threading.get_ident()
        session.start(profiler, "auto", release=self.release)
        self.inference = StepInference(profiler, has_optimizer=self.has_optimizer)
        self.state = "active"
        self._watch_roots_globally()
        atexit.register(self.shutdown)
        log.info("stepscope: zero-code profiling of this process started")

    def release(self) -> None:
        """Another owner took the steps: close zero-code's, and stop observing the loop."""
        inference, self.inference = self.inference, None
        self._module_hooks.undo()
        self.state = "passive"
        if inference is not None:
            inference.finish()

    def shutdown(self, failure: BaseException | None = None) -> None:
        """The process ends (with `failure` uncaught): close the open step, and the profiler
        zero-code started, whoever took its steps since."""
        inference, self.inference = self.inference, None
        self._module_hooks.undo()
        self.state = "off"
        if inference is not None:
            inference.finish(failed=failure is not None)
        running = session.current()
        if self.profiler is None or running is None or running.profiler is not self.profiler:
            return
        if failure is None:
            self.profiler.close()
        else:  # the exception event (with its step), then close as failed
            self.profiler.__exit__(type(failure), failure, failure.__traceback__)

    # ---- patches ---------------------------------------------------------------------------

    def patch_torch(self, torch: ModuleType) -> None:
        """Everything zero-code observes, patched once torch is imported."""
        from torch.optim import optimizer
        from torch.utils.data import dataloader

        self._is_compiling = is_compiling = torch.compiler.is_compiling
        self._grad_enabled = torch.is_grad_enabled
        self._unobservable = is_compiling
        if torch.cuda.is_available():
            capturing = torch.cuda.is_current_stream_capturing
            self._unobservable = lambda: is_compiling() or capturing()
        patches = self.patches
        patches.wrap(optimizer.Optimizer, "__init__", self._optimizer_init)
        patches.handle(optimizer.register_optimizer_step_pre_hook(self._optimizer_pre))
        patches.handle(optimizer.register_optimizer_step_post_hook(self._optimizer_post))
        patches.wrap(dataloader._BaseDataLoaderIter, "__next__", self._next_batch)
        patches.wrap(torch.autograd, "_engine_run_backward", self._backward)
        patches.wrap(torch.amp.grad_scaler.GradScaler, "step", self._scaler_step)
        patches.wrap(os, "_exit", self._exit)
        patches.wrap(sys, "excepthook", self._excepthook)

    def _optimizer_init(self, original: Callable[..., None]) -> Callable[..., None]:
        zero_code = self

        @functools.wraps(original)
        def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            original(optimizer, *args, **kwargs)
            zero_code.has_optimizer = True
            if zero_code.inference is not None:
                zero_code.inference.has_optimizer = True
            elif zero_code.state == "waiting":
                zero_code.activate()

        return __init__

    # Each signal below is fail-open: an error turns zero-code's steps off (_fail), never
    # reaching training. The try blocks and the checks that a signal is observed (on the
    # training thread, outside compiled regions and CUDA graph capture) are inline: they run a
    # few times a step.

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        inference = self.inference
        if inference is None or get_ident() != self._thread_id or self._unobservable():
            return
        try:
            inference.optimizer_begins()
        except Exception as exc:
            self._fail(exc)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        inference = self.inference
        if inference is None or get_ident() != self._thread_id or self._unobservable():
            return
        try:
            inference.optimizer_ends()
            if not self._roots_found:
                self._end_discovery(inference)
        except Exception as exc:
            self._fail(exc)

    def _scaler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        zero_code = self

        @functools.wraps(original)
        def step(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            inference = zero_code.inference
            if (
                inference is None
                or get_ident() != zero_code._thread_id
                or zero_code._unobservable()
            ):
                return original(scaler, *args, **kwargs)
            # A step the scaler skips is still an update's step.
            zero_code._optimizer_pre(None, None, None)
            try:
                return original(scaler, *args, **kwargs)
            finally:
                zero_code._optimizer_post(None, None, None)

        return step

    def _next_batch(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        zero_code = self
        clock = time.perf_counter

        @functools.wraps(original)
        def __next__(iterator: Any) -> Any:
            if zero_code.state == "waiting":
                zero_code.activate()
            inference = zero_code.inference
            if inference is None or get_ident() != zero_code._thread_id:
                return original(iterator)
            try:
                if not zero_code._roots_found:
                    zero_code._end_discovery(inference)
                inference.data_wait_begins()
            except Exception as exc:
                zero_code._fail(exc)
            start = clock()
            batch = original(iterator)
            waited_s = clock() - start
            try:
                inference.data_waited(start, waited_s, batch)
            except Exception as exc:
                zero_code._fail(exc)
            return batch

        return __next__

    def _backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        zero_code = self

        @functools.wraps(original)
        def run_backward(*args: Any, **kwargs: Any) -> Any:
            if zero_code.state == "waiting":
                zero_code.activate()
            inference = zero_code.inference
            # Not in a compiled region: dynamo does not trace a backward() call.
            if inference is None or get_ident() != zero_code._thread_id:
                return original(*args, **kwargs)
            try:
                inference.backward_begins()
            except Exception as exc:
                zero_code._fail(exc)
            try:
                return original(*args, **kwargs)
            finally:
                try:
                    inference.backward_ends()
                except Exception as exc:
                    zero_code._fail(exc)

        return run_backward

    def _exit(self, original: Callable[[int], Any]) -> Callable[[int], Any]:
        """os._exit skips atexit: close the profiler first (scripts under torchrun use it)."""
        zero_code = self

        @functools.wraps(original)
        def _exit(status: int) -> Any:
            try:
                zero_code.shutdown()
            except Exception:
                log.debug("stepscope: zero-code did not close cleanly", exc_info=True)
            return original(status)

        return _exit

    def _excepthook(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """An uncaught exception ends the process: say so (its step failed), then close."""
        zero_code = self

        def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> Any:
            try:
                zero_code.shutdown(failure=exc)
            except Exception:
                log.debug("stepscope: zero-code did not close cleanly", exc_info=True)
            return original(exc_type, exc, tb)

        return excepthook

    def _fail(self, exc: BaseException) -> None:
        """Zero-code failed: its steps stop (said once, in the log and as an event)."""
        if self.inference is None:
            return
        self.inference = None
        self.state = "off"
        self._module_hooks.undo()
        log.warning("stepscope: zero-code's steps are off after an error", exc_info=exc)
        if self.profiler is not None:
            self.profiler.event(
                "exception", f"stepscope zero-code failed, its steps are off: {exc!r}"
            )

    # ---- root modules ----------------------------------------------------------------------

    def _watch_roots_globally(self) -> None:
        """Global module hooks until the roots are known (they cost every module its fast path)."""
        from torch.nn.modules import module

        hooks = self._module_hooks
        hooks.handle(module.register_module_forward_pre_hook(self._global_pre))
        hooks.handle(module.register_module_forward_hook(self._global_post, always_call=True))
        # A compiled module warns of them at each call; they skip compiled regions, so its
        # warning (hooks firing again inside) is not the user's to read.
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING, category=UserWarning)
        hooks.on_undo(functools.partial(_remove_filter, warnings.filters[0]))

    def _end_discovery(self, inference: StepInference) -> None:
        """After the first steps, the roots alone are timed; the global hooks go (called
        outside any module's forward)."""
        if inference.num_steps <= DISCOVERY_STEPS:
            return
        from torch.nn.modules.module import Module

        self._module_hooks.undo()
        self._roots_found = True
        hooks = self._module_hooks
        for root in self._roots.values():
            # The forward includes the root's own hooks (FSDP2 gathers the root's parameters in
            # its pre-forward hook), as global hooks and step() see it.
            if type(root).__call__ is Module.__call__ and vars(root).get(_CALL) is None:
                # nn.Module.__call__ calls an instance's `_compiled_call_impl` (module.compile()
                # sets it) in place of `_call_impl`. Hooks would cost the root nn.Module's slow
                # path (~17k instructions a call), and, bound to zero-code, make copy.deepcopy
                # and torch.save of the model fail; copies and pickles drop this attribute.
                call = functools.partial(self._call_root, root)
                setattr(root, _CALL, call)
                hooks.on_undo(functools.partial(_unwrap_root, root, call))
            else:  # its own __call__, or compiled: first in, last out
                hooks.handle(root.register_forward_pre_hook(self._root_pre, prepend=True))
                hooks.handle(root.register_forward_hook(self._root_post, always_call=True))

    def _call_root(self, root: Any, *args: Any, **kwargs: Any) -> Any:
        """A root's call, its forward timed (hooks included), as _root_pre and _root_post do."""
        inference = self.inference
        if inference is None or get_ident() != self._thread_id or self._unobservable():
            return root._call_impl(*args, **kwargs)
        try:
            timed = inference.forward_begins(root.training and self._grad_enabled())
        except Exception as exc:
            self._fail(exc)
            timed = False
        if not timed:
            return root._call_impl(*args, **kwargs)
        try:
            return root._call_impl(*args, **kwargs)
        finally:
            inference = self.inference
            if inference is not None:
                try:
                    inference.forward_ends()
                except Exception as exc:
                    self._fail(exc)

    def _global_pre(self, module: Any, args: Any) -> None:
        if self._is_compiling():
            return
        if get_ident() != self._thread_id:
            return
        self._depth += 1
        if self._depth == 1:
            if id(module) not in self._roots:
                self._roots[id(module)] = module
                if self.profiler is not None:
                    self.profiler.watch(module)  # an FSDP2 or TP model's mesh
            self._root_pre(module, args)

    def _global_post(self, module: Any, args: Any, output: Any) -> None:
        if self._is_compiling():
            return
        if get_ident() != self._thread_id:
            return
        self._depth -= 1
        if self._depth == 0:
            self._root_post(module, args, output)

    def _root_pre(self, module: Any, args: Any) -> None:
        inference = self.inference
        if inference is None or get_ident() != self._thread_id or self._unobservable():
            self._timed.append(False)
            return
        try:
            timed = inference.forward_begins(module.training and self._grad_enabled())
        except Exception as exc:
            self._fail(exc)
            timed = False
        self._timed.append(timed)

    def _root_post(self, module: Any, args: Any, output: Any) -> None:
        timed = self._timed.pop() if self._timed else False
        inference = self.inference
        if timed and inference is not None:
            try:
                inference.forward_ends()
            except Exception as exc:
                self._fail(exc)


_COMPILE_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"
_CALL = "_compiled_call_impl"
"""What nn.Module.__call__ calls in place of `_call_impl` when an instance sets it."""


def _unwrap_root(root: Any, call: Any) -> None:
    """The root's calls go to `_call_impl` again (unless module.compile() replaced `call`)."""
    if vars(root).get(_CALL) is call:
        delattr(root, _CALL)


def _remove_filter(entry: Any) -> None:
    filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at runtime
    if entry in filters:
        filters.remove(entry)
        mutated = getattr(warnings, "_filters_mutated", None)  # the once-per-place caches
        if mutated is not None:
            mutated()


def _never() -> bool:
    return False


def _in_worker_or_agent() -> bool:
    """A DataLoader worker, or torchrun's agent (it imports torch but trains nothing)."""
    data = sys.modules.get("torch.utils.data")
    if data is not None and data.get_worker_info() is not None:
        return True
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is not None and main_spec.name == "torch.distributed.run":
        return True  # python -m torch.distributed.run
    return os.path.basename(sys.argv[0] if sys.argv else "") == "torchrun"


_zero_code: ZeroCode | None = None


def install() -> None:
    """Zero-code for this process: wait for torch, then observe (once a process)."""
    global _zero_code
    if _zero_code is not None:
        return
    zero_code = _zero_code = ZeroCode()
    passive.install(activate=zero_code.activate)
    when_imported("torch", zero_code.patch_torch)


def uninstall() -> None:
    """Close zero-code's profiler and undo every patch (tests)."""
    global _zero_code
    zero_code, _zero_code = _zero_code, None
    if zero_code is not None:
        zero_code.shutdown()
        zero_code.patches.undo()
    passive.uninstall()
