"""The active profiler: steps, sections, dataloader and collective timing, FLOPs, telemetry.

Hot-path methods only take clock marks and append to in-memory records; the shipper thread
turns finished steps into wire rows (without blocking) before it builds each batch. Every
public method is fail-open: an internal error is logged once, reported as an event,
and turns the profiler off; it never reaches the training loop.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from stepscope._version import __version__
from stepscope.profiler import session
from stepscope.profiler.base import NULL_CONTEXT, Profiler
from stepscope.profiler.collectives.calls import CollectiveCall
from stepscope.profiler.collectives.ddp import DdpStepTimer, make_ddp_hook
from stepscope.profiler.collectives.groups import GroupRegistry
from stepscope.profiler.config import Config, RunEnv, default_flush_interval_s
from stepscope.profiler.hangs.watchdog import TrainingState, Watchdog
from stepscope.profiler.lifecycle import detect_lifecycle
from stepscope.profiler.loop.finished import FinishedSteps, json_safe
from stepscope.profiler.loop.scopes import Phase, Section, Step, TimedLoader
from stepscope.profiler.loop.steps import StepRecord
from stepscope.profiler.shipping.otlp import build_otlp_metrics
from stepscope.profiler.shipping.shipper import Shipper
from stepscope.profiler.telemetry.capture import DeepCapture, build_capture
from stepscope.profiler.telemetry.flops import measure_flops, peak_flops_for
from stepscope.profiler.timer import Clock, Mark, build_clock
from stepscope.schema import EVENT_KINDS, STEPS

log = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_STEP_COLUMNS = frozenset(c.name for c in STEPS.wire_columns)
_MAX_CALLS_OUTSIDE_STEPS = 10_000
"""Collectives held until a step() ends; beyond that (e.g. no step() ever) new ones are dropped."""


def _fail_open(default: Any = None) -> Callable[[F], F]:
    """Run a public method; on an internal error, report it, disable profiling, return `default`."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: ActiveProfiler, *args: Any, **kwargs: Any) -> Any:
            if self._broken:
                return default
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                self._fail(exc)
                return default

        return wrapper  # type: ignore[return-value]

    return decorate


class ActiveProfiler(Profiler):
    """Profiles this rank and ships its records to the collector."""

    enabled = True

    def __init__(self, *, config: Config, env: RunEnv, model: Any = None) -> None:
        self.config = config
        self.env = env
        self._broken = False
        self._closed = False
        self._clock: Clock = build_clock("cpu")
        self._device_type: str | None = None
        self._next_index = 0
        self._current: StepRecord | None = None
        self._calls: list[CollectiveCall] = []
        self._pre_data_s = 0.0
        self._pre_data_start: float | None = None
        self._pre_values: dict[str, Any] = {}
        self._step_start = 0.0
        self._groups = GroupRegistry()
        self._flops_per_step: float | None = (
            float(config.flops_per_step) if isinstance(config.flops_per_step, int | float) else None
        )
        self._flop_counter: Any = None
        self._watched: set[int] = set()
        self._step_timers: list[DdpStepTimer] = []
        # What the watchdog reads (plain stores on the hot path).
        self._section: str | None = None
        self._phase: str | None = None
        self._phase_changed_at: float | None = None
        self._first_step: int | None = None
        self._ended_step: int | None = None
        self._ended_at: float | None = None
        self._main_thread_id = threading.get_ident()
        self._watchdog: Watchdog | None = None
        self._resumed_from: int | None = None
        self._failed_step: int | None = None
        self._open_sections: list[tuple[str, Mark, str | None]] = []
        """Sections opened by begin_section(), innermost last: (name, start mark, the section
        open before it)."""
        job_id = config.job_id or f"{env.node}-{env.pid}-{int(time.time())}"
        self.job_id = job_id
        self.incarnation = uuid.uuid4().hex
        attributes = {
            "stepscope_version": __version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
        }
        attributes.update(env.job_attributes)
        attributes.update(config.attributes)
        job = {
            "job_id": job_id,
            "name": config.name,
            "benchmark_key": config.benchmark_key,
            "world_size": env.world_size,
            "device_name": None,
            "peak_flops": config.peak_flops,
            "attributes": attributes,
        }
        source = {
            "rank": env.rank,
            "local_rank": env.local_rank,
            "node": env.node,
            "pid": env.pid,
            "incarnation": self.incarnation,
            "attributes": dict(env.rank_attributes) or None,
        }
        self._otlp = (
            build_otlp_metrics(
                endpoint=config.otlp_endpoint,
                job=job,
                source=source,
                export_interval_s=config.flush_interval_s
                or default_flush_interval_s(env.world_size),
                token=config.token,
            )
            if config.otlp_endpoint
            else None
        )
        self._capture: DeepCapture | None = build_capture(config)
        self.shipper = Shipper(
            config=config,
            job=job,
            source=source,
            tee=self._otlp.record if self._otlp is not None else None,
            on_capture=self._capture.offer if self._capture is not None else None,
        )
        self._finished = FinishedSteps(
            self.shipper.add,
            clock=self._clock,
            groups=self._groups,
            close_timeout_s=config.close_timeout_s,
        )
        self.shipper.before_batch = self._finished.ship_ready
        self._send_start()
        self._tap: Any = None
        if config.patch_collectives and dist.is_available():
            from stepscope.profiler.collectives.tap import (
                CollectiveTap,  # needs torch.distributed's C++ classes
            )

            self._tap = CollectiveTap(
                clock=self._clock,
                calls=self._calls,
                groups=self._groups,
                on_error=self._tap_failed,
                max_calls=_MAX_CALLS_OUTSIDE_STEPS,
            )
            self._tap.install()
        self._unobserved: list[Any] = self._tap.unobserved if self._tap is not None else []
        """The tap's async work not yet looked at: at each boundary in the training loop
        (a section's or step's start or end) the tap looks at it (completed work ends there;
        the rest gets a completion callback). Read inline there: a call costs a frame."""
        self._gpu_sampler = self._start_gpu_sampler()
        self._watchdog = self._start_watchdog(source)
        if model is not None:
            self.watch(model)

    # ---- public API ----------------------------------------------------------------------

    def step(self, step: int | None = None) -> AbstractContextManager[None]:
        if self._broken:
            return NULL_CONTEXT
        return Step(self, step)

    def section(self, name: str) -> AbstractContextManager[None]:
        if self._broken:
            return NULL_CONTEXT
        return Section(self, name)

    # begin_step and end_step run every step under zero-code and the adapters: fail-open
    # inline (as Step does), without _fail_open's frame.

    def begin_step(self, step: int | None = None) -> None:
        if self._broken:
            return
        try:
            self._begin_step(step)
        except Exception as exc:
            self._fail(exc)

    def end_step(self, *, failed: bool = False) -> None:
        if self._broken:
            return
        try:
            if failed and self._current is not None:
                self._failed_step = self._current.step
            self._end_step(failed=failed)
        except Exception as exc:
            self._fail(exc)

    # begin_section and end_section run a few times a step under zero-code and the adapters:
    # what entering and leaving a Section does, on a (name, start, outer) entry, without a
    # Section object and its two calls.

    def begin_section(self, name: str) -> None:
        if self._broken:
            return
        try:
            if self._unobserved:  # a boundary: see Loop._unobserved
                self._tap.observe()
            self._open_sections.append((name, self._clock.mark(), self._section))
            self._section = name  # for the watchdog
        except Exception as exc:
            self._fail(exc)

    def end_section(self, name: str) -> None:
        sections = self._open_sections
        i = len(sections) - 1
        while i >= 0 and sections[i][0] != name:  # the innermost, as a rule
            i -= 1
        if i < 0:
            return
        _, start, self._section = sections.pop(i)
        if self._broken:
            return
        try:
            if self._unobserved:
                self._tap.observe()
            current = self._current
            if current is not None:
                current.spans.append((name, start, self._clock.mark()))
        except Exception as exc:
            self._fail(exc)

    def record_data_wait(self, waited_s: float, *, started_at: float) -> None:
        current = self._current
        if current is not None:
            current.data_s += waited_s
        else:  # before the step: the next step's, which starts at the first wait
            if self._pre_data_start is None:
                self._pre_data_start = started_at
            self._pre_data_s += waited_s

    def phase(self, name: str) -> AbstractContextManager[None]:
        if self._broken:
            return NULL_CONTEXT
        return Phase(self, str(name))

    @_fail_open()
    def resumed_from(self, step: int) -> None:
        self._resumed_from = int(step)
        if self._first_step is None:  # steps numbered by the profiler go on from there
            self._next_index = self._resumed_from
        else:  # declared after the first step: say it now
            self._lifecycle_event(
                "resume", time.time(), step=self._first_step, resumed_from=self._resumed_from
            )

    def wrap_dataloader(self, loader: Iterable[T]) -> Iterable[T]:
        if self._broken:
            return loader
        return TimedLoader(loader, self)

    @_fail_open()
    def watch(self, model: Any) -> None:
        if self._watch_layout(model):
            return
        self._set_device(_device_type_of(model))
        self._check_cuda_device(model)
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        timing = self.config.comm_timing
        if id(model) in self._watched or timing == "off":
            return
        if timing == "step":
            self._step_timers.append(
                DdpStepTimer(
                    model,
                    clock=self._clock,
                    record=self._record_call,
                    groups=self._groups,
                    on_error=self._tap_failed,
                )
            )
        else:
            hook = make_ddp_hook(
                clock=self._clock,
                record=self._record_call,
                groups=self._groups,
                on_error=self._tap_failed,
            )
            try:
                model.register_comm_hook(model.process_group, hook)
            except RuntimeError as exc:  # e.g. the user registered a hook of their own
                self.event("custom", f"stepscope could not time DDP all-reduces: {exc}")
                return
        self._watched.add(id(model))

    def _watch_layout(self, target: Any) -> bool:
        """Learn the mesh of a DeviceMesh, a pipeline stage, or a model's DTensor parameters
        (its groups' labels and this rank's coordinates); True when `target` was not a model."""
        groups = self._groups
        stage_index = getattr(target, "stage_index", None)
        if isinstance(stage_index, int) and hasattr(target, "num_stages"):
            groups.add_stage(stage_index, int(target.num_stages), getattr(target, "group", None))
            self._set_device(_device_type_of(target.submod))
            found, is_model = True, False
        elif hasattr(target, "mesh_dim_names") and hasattr(target, "get_coordinate"):
            found, is_model = groups.add_mesh(target), False
        else:
            added = [groups.add_mesh(m) for m in _meshes_of(target)]  # all: 2-D has two
            found, is_model = any(added), True
        if found:
            self.shipper.update_source(mesh=dict(groups.mesh))
        return not is_model

    def record(
        self, *, tokens: int | None = None, samples: int | None = None, **custom: Any
    ) -> None:
        # Every step, by hand and under zero-code: fail-open inline, without _fail_open's frame.
        if self._broken:
            return
        try:
            current = self._current
            values = current.values if current is not None else self._pre_values
            if tokens is not None:
                values["tokens"] = int(tokens)
            if samples is not None:
                values["samples"] = int(samples)
            for key, value in custom.items():
                if key in _STEP_COLUMNS:
                    values[key] = value
                elif current is not None:
                    current.custom[key] = value
                else:
                    values.setdefault("_custom", {})[key] = value
        except Exception as exc:
            self._fail(exc)

    @_fail_open()
    def set_work_counts(
        self,
        *,
        tokens_per_step: int | None = None,
        samples_per_step: int | None = None,
        flops_per_step: float | Literal["auto"] | None = None,
    ) -> None:
        """Work counts of every step from now on (None keeps what was set)."""
        config = self.config
        if tokens_per_step is not None:
            config.tokens_per_step = int(tokens_per_step)
        if samples_per_step is not None:
            config.samples_per_step = int(samples_per_step)
        if flops_per_step is not None:
            config.flops_per_step = flops_per_step
            if flops_per_step != "auto":
                self._flops_per_step = float(flops_per_step)

    @_fail_open()
    def event(self, kind: str, message: str, **attributes: Any) -> None:
        if kind not in EVENT_KINDS:
            attributes["kind"] = kind
            kind = "custom"
        self.shipper.add(
            "events",
            {
                "ts": time.time(),
                "kind": kind,
                "message": str(message),
                "attributes": json_safe(attributes),
            },
        )

    @_fail_open()
    def measure_flops(self, fn: Callable[[], object]) -> float | None:
        self._flops_per_step = measure_flops(fn)
        return self._flops_per_step

    def close(self, *, failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        running = session.current()
        if running is not None and running.profiler is self:
            session.end()
        if self._watchdog is not None:
            self._watchdog.stop(timeout_s=1.0)
        try:
            if self._current is not None:
                self._end_step(failed=failed)
            self._finished.flush()
            if self._calls:  # collectives after the last step: a row of their own
                orphan = StepRecord(
                    step=self._next_index, ts=time.time(), base=self._calls[0].start
                )
                orphan.calls = self._calls.copy()
                self._calls.clear()
                _, rows = orphan.to_rows(self._clock, self._groups.mesh_dims)
                for row in rows:
                    self.shipper.add("collectives", row)
        except Exception as exc:
            self._fail(exc)  # reported (an event), and the rest of close() goes on
        if self._tap is not None:
            self._tap.remove()
        for timer in self._step_timers:
            timer.remove()
        if self._gpu_sampler is not None:
            try:
                self._gpu_sampler.stop()
            except Exception:
                log.debug("stepscope: GPU sampler did not stop cleanly", exc_info=True)
        if self._capture is not None:
            self._capture.close(timeout_s=self.config.close_timeout_s)
        self._lifecycle_event("exit", time.time(), failed=int(failed))
        final_job = None
        if self.env.rank == 0:
            final_job = {"status": "failed" if failed else "finished", "ended_at": time.time()}
        if not self.shipper.close(final_job=final_job):
            log.warning(
                "stepscope: %s records not acknowledged at close (collector unreachable?)",
                "some" if sum(self.shipper.stats.num_rows_sent.values()) else "all",
            )
        if self._otlp is not None:
            self._otlp.close(timeout_s=self.config.close_timeout_s)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if exc is not None:
            failed_step = self._failed_step if self._failed_step is not None else self._next_index
            # The incarnation places the exception in its process, whatever the clocks say.
            self.event(
                "exception",
                f"{type(exc).__name__}: {exc}",
                step=failed_step,
                incarnation=self.incarnation,
            )
        self.close(failed=exc is not None)
        return False

    # ---- hot path ------------------------------------------------------------------------

    def _begin_step(self, index: int | None) -> None:
        if self._current is not None:  # step() entered twice without exit: close the first
            self._end_step(failed=False)
        now = time.perf_counter()
        if self._device_type is None:
            self._set_device(_current_device_type())
        start = self._pre_data_start if self._pre_data_start is not None else now
        index = self._next_index if index is None else index
        if self._first_step is None:
            self._first_step = index
            self._lifecycle_event(
                "resume", time.time() - (now - start), step=index, resumed_from=self._resumed_from
            )
        record = StepRecord(
            step=index,
            ts=time.time() - (now - start),
            base=self._clock.mark(),
            data_s=self._pre_data_s,
        )
        if self.step_rule is not None:
            record.values["step_rule"] = self.step_rule
        if self._pre_values:
            custom = self._pre_values.pop("_custom", None)
            record.values.update(self._pre_values)
            if custom:
                record.custom.update(custom)
            self._pre_values = {}
        self._pre_data_s = 0.0
        self._pre_data_start = None
        self._step_start = start
        self._next_index = index + 1
        if self.config.flops_per_step == "auto" and self._flops_per_step is None:
            self._start_flop_count()
        self._current = record
        capture = self._capture
        if capture is not None and capture.armed:
            capture.before_step(index)

    def _end_step(self, *, failed: bool) -> None:
        record = self._current
        if record is None:
            return
        self._current = None
        now = time.perf_counter()
        record.step_s = now - self._step_start
        if self._unobserved:
            self._tap.observe()
        self._ended_step, self._ended_at = record.step, now
        record.calls = self._calls.copy()  # the tap appends to this list: keep it
        self._calls.clear()
        if self._flop_counter is not None:
            self._stop_flop_count()
        values = record.values
        if "tokens" not in values and self.config.tokens_per_step is not None:
            values["tokens"] = self.config.tokens_per_step
        if "samples" not in values and self.config.samples_per_step is not None:
            values["samples"] = self.config.samples_per_step
        if "flops" not in values and self._flops_per_step is not None:
            values["flops"] = self._flops_per_step
        if self._device_type == "cuda":
            values["mem_peak_bytes"] = int(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        self._finished.append(record)  # the shipper thread turns it into rows
        capture = self._capture
        if capture is not None and capture.armed:
            capture.after_step(record.step)  # after step_s: its stop is in no step's time

    def _record_call(self, call: CollectiveCall) -> None:
        if not self._broken and len(self._calls) < _MAX_CALLS_OUTSIDE_STEPS:
            self._calls.append(call)

    # ---- off the hot path ----------------------------------------------------------------

    def _send_start(self) -> None:
        """The `start` event: when this process started, its restart count, scheduler times."""
        try:
            life = detect_lifecycle()
            self._lifecycle_event(
                "start",
                life.started_at,
                restart_count=life.restart_count,
                submitted_at=life.submitted_at,
                scheduled_at=life.scheduled_at,
                init_at=time.time(),
            )
        except Exception:
            log.warning("stepscope: could not read this process's start", exc_info=True)

    def _lifecycle_event(self, kind: str, ts: float, **attributes: Any) -> None:
        """Ship a lifecycle event (schema.LIFECYCLE_ATTRIBUTES) of this process; never raises."""
        try:
            self.shipper.add(
                "events",
                {
                    "ts": ts,
                    "kind": kind,
                    "message": _lifecycle_message(kind, attributes),
                    "attributes": {"incarnation": self.incarnation, **attributes},
                },
            )
        except Exception:
            log.debug("stepscope: lifecycle event %s not sent", kind, exc_info=True)

    def _set_device(self, device_type: str | None) -> None:
        if device_type is None or device_type == self._device_type:
            return
        if self._device_type is not None and self._next_index > 0:
            return  # the clock cannot change under recorded steps
        self._device_type = device_type
        self._clock = build_clock(device_type)
        self._finished.clock = self._clock
        if self._tap is not None:
            self._tap.clock = self._clock
        if device_type == "cuda":
            device_name = torch.cuda.get_device_name(torch.cuda.current_device())
        else:
            device_name = device_type
        peak_flops = self.config.peak_flops
        if peak_flops is None:
            peak_flops = peak_flops_for(device_name)
        self.shipper.update_job(device_name=device_name, peak_flops=peak_flops)
        if self._otlp is not None:
            self._otlp.peak_flops = peak_flops
        if peak_flops is None and self.env.rank == 0:
            self.event(
                "custom",
                f"peak FLOP/s unknown for device {device_name!r}: no MFU is computed. "
                "Pass peak_flops= to stepscope.init() or set STEPSCOPE_PEAK_FLOPS.",
                device_name=device_name,
                reason="device not in the peak FLOP/s table and no peak_flops given",
            )

    def _check_cuda_device(self, model: Any) -> None:
        """Say so when the model is on another GPU than this thread's current one: the CUDA
        clock records its events on the current device's stream, which does not run the model."""
        device = _device_of(model)
        if self._device_type != "cuda" or device is None or device.index is None:
            return
        current = torch.cuda.current_device()
        if device.index != current:
            message = (
                f"the model is on cuda:{device.index} but the current CUDA device is "
                f"cuda:{current}: stepscope's CUDA events go on the current device's stream and "
                f"do not time the model. Call torch.cuda.set_device({device.index}) before "
                "stepscope.init()."
            )
            log.warning("stepscope: %s", message)
            self.event("custom", message, reason="model not on the current CUDA device")

    def _start_flop_count(self) -> None:
        from stepscope.profiler.telemetry.flops import RankFlopCounter

        self._flop_counter = RankFlopCounter()
        self._flop_counter.__enter__()

    def _stop_flop_count(self) -> None:
        counter, self._flop_counter = self._flop_counter, None
        counter.__exit__(None, None, None)
        self._flops_per_step = float(counter.get_total_flops())

    def _start_gpu_sampler(self) -> Any:
        try:
            from stepscope.profiler.telemetry.nvml import GpuSampler, host_gpu
        except ImportError:
            return None
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            device = host_gpu(self.env.local_rank, visible)
            if device is None:
                log.info(
                    "stepscope: GPU telemetry off: no GPU of local rank %d in "
                    "CUDA_VISIBLE_DEVICES=%r that NVML can open",
                    self.env.local_rank,
                    visible,
                )
                return None
            sampler = GpuSampler.create(
                interval_s=self.config.gpu_interval_s,
                device=device,
                emit=functools.partial(self.shipper.add, "gpu"),
            )
            if sampler is not None:
                uuid = sampler.uuid()
                if uuid is not None:
                    # The GPU's identity rides with the rank, like its node (DESIGN §8).
                    attributes = {**self.env.rank_attributes, "gpu.uuid": uuid}
                    self.shipper.update_source(attributes=attributes)
                sampler.start()
            return sampler
        except Exception:
            log.warning("stepscope: GPU telemetry off after an error", exc_info=True)
            return None

    def _start_watchdog(self, source: dict[str, Any]) -> Watchdog | None:
        if not self.config.hang_watchdog:
            return None
        identity = {
            "job_id": self.job_id,
            "rank": source["rank"],
            "incarnation": self.incarnation,
            "node": source["node"],
            "pid": source["pid"],
            "world_size": self.env.world_size,
        }
        tap = self._tap
        try:
            watchdog = Watchdog(
                config=self.config,
                identity=identity,
                state=self._training_state,
                groups=self._groups,
                waiting=lambda: tap.waiting if tap is not None and tap.enabled else None,
                main_thread_id=self._main_thread_id,
                device_calls=self._device_calls,
            )
            watchdog.start()
            return watchdog
        except Exception:
            log.warning("stepscope: hang watchdog off after an error", exc_info=True)
            return None

    def _device_calls(self) -> tuple[list[CollectiveCall], Callable[[Any], bool]] | None:
        """On a device clock, the collectives not yet shipped (read by the watchdog thread)."""
        clock = self._clock
        if clock.name == "cpu":
            return None
        return [*self._calls, *self._finished.calls()], clock.is_ready

    def _training_state(self) -> TrainingState:
        """The progress marks the training thread stored (read by the watchdog thread)."""
        return TrainingState(
            step=self._next_index - 1 if self._first_step is not None else None,
            first_step=self._first_step,
            ended_step=self._ended_step,
            ended_at=self._ended_at,
            section=self._section,
            phase=self._phase,
            phase_changed_at=self._phase_changed_at,
        )

    def _tap_failed(self, exc: BaseException) -> None:
        """Collective timing (the tap or DDP's) turned itself off: say so (training and the
        rest go on)."""
        self.event(
            "exception",
            f"stepscope's collective timing failed and is off: {type(exc).__name__}: {exc}",
        )

    def _fail(self, exc: BaseException) -> None:
        """Turn profiling off after an internal error, and say so once (log and event)."""
        if self._broken:
            return
        self._broken = True
        self._current = None
        if self._watchdog is not None:  # no progress is stored any more: no false hangs
            self._watchdog.stop()
        log.exception("stepscope: internal error, profiling is off for this rank", exc_info=exc)
        if self._tap is not None:
            self._tap.enabled = False
        if self._flop_counter is not None:
            try:
                self._flop_counter.__exit__(None, None, None)
            except Exception:
                log.debug("stepscope: flop counter did not exit cleanly", exc_info=True)
            self._flop_counter = None
        try:
            self.shipper.add(
                "events",
                {
                    "ts": time.time(),
                    "kind": "exception",
                    "message": f"stepscope internal error, profiling off: "
                    f"{type(exc).__name__}: {exc}",
                    "attributes": {"pid": os.getpid()},
                },
            )
        except Exception:
            log.debug("stepscope: could not report the internal error", exc_info=True)


def _lifecycle_message(kind: str, attributes: dict[str, Any]) -> str:
    """A lifecycle event in words, for the events list."""
    if kind == "start":
        restart = attributes.get("restart_count")
        return "process started" + (f" (restart {restart})" if restart else "")
    if kind == "resume":
        return f"first step {attributes.get('step')}"
    if kind == "phase":
        return f"{attributes.get('name')} for {attributes.get('duration_s', 0.0):.3f} s"
    return "exit (failed)" if attributes.get("failed") else "exit"


def _device_of(model: Any) -> Any:
    """The device of the model's first parameter (None without one)."""
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return None


def _device_type_of(model: Any) -> str | None:
    device = _device_of(model)
    return None if device is None else str(device.type)


def _meshes_of(model: Any) -> list[Any]:
    """The DeviceMeshes of a model's DTensor parameters (FSDP2, tensor parallel)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return []
    meshes: dict[int, Any] = {}
    try:
        for param in model.parameters():
            if isinstance(param, DTensor):
                meshes.setdefault(id(param.device_mesh), param.device_mesh)
    except (AttributeError, TypeError):
        return []
    return list(meshes.values())


def _current_device_type() -> str:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "cuda"
    return "cpu"
