"""torchtitan's structured logger as the source of a rank's steps: a logging handler that turns
its span and scalar records into the profiler's steps, sections, data waits and token counts.

torchtitan (0.3.0) calls each factory named in TITAN_STRUCT_LOGGER_HANDLERS on every rank, and
only those: `HANDLER_FACTORIES` names its own JSONL factory first, so its files are still written.
Each record is handled when torchtitan emits it, on the training thread at the span's start or
end, so sections take the profiler's clock marks (CUDA events on a GPU) at that moment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from stepscope.integrations.claim import claim_profiler
from stepscope.profiler.base import Profiler
from stepscope.profiler.launch.launcher import TORCHTITAN_HANDLERS

log = logging.getLogger(__name__)

HANDLER_FACTORIES = TORCHTITAN_HANDLERS
"""The value of TITAN_STRUCT_LOGGER_HANDLERS that keeps torchtitan's JSONL files and adds ours
(what `stepscope run` sets unless the variable is set)."""

SECTIONS = {"fwd_bwd": "fwd_bwd", "optim": "optimizer"}
"""torchtitan span → stepscope section. fwd_bwd is forward and backward in one call (once per
gradient-accumulation group): no column holds both, so it is kept as the custom value fwd_bwd_s."""
PHASES = ("eval",)
"""Spans that are stepscope phases. Checkpoint spans are not: torchtitan's checkpoint_save wraps a
call made every step, and torch.distributed.checkpoint's save and load are phases already."""
TOKENS_SCALAR = "local_valid_tokens"
"""The scalar counting this rank's tokens of the step (labels not ignored, all micro-batches)."""


class StepFailed(Exception):
    """torchtitan's step span ended with an exception (the text is its step_error record's)."""


class StepscopeHandler(logging.Handler):
    """Turns torchtitan's structured-logger records into profiler calls; fail-open."""

    def __init__(self, profiler: Profiler, relative_step: Callable[[], int | None]) -> None:
        super().__init__()
        self.profiler = profiler
        self._relative_step = relative_step
        self._seen_step = False
        self._step_failed = False
        self._error: str | None = None
        """The text of the last step_error record: the exception that ended the training."""
        self._phases: list[AbstractContextManager[None]] = []
        self._broken = False
        self._profiling = True
        actions: dict[str, Callable[[logging.LogRecord], None]] = {
            "step_start": self._step_start,
            "step_error": self._step_error,
            "step_end": self._step_end,
            "fetching_batch_end": self._batch_fetched,
            "metric_value": self._scalar,
        }
        for span, section in SECTIONS.items():
            actions[f"{span}_start"] = _section_start(profiler, section)
            actions[f"{span}_end"] = _section_end(profiler, section)
        for name in PHASES:
            actions[f"{name}_start"] = self._phase_start(name)
            actions[f"{name}_end"] = self._phase_end
        self._actions = actions

    def emit(self, record: logging.LogRecord) -> None:
        if self._broken:
            return
        action = self._actions.get(getattr(record, "log_type_name", ""))
        if action is None:
            return
        try:
            action(record)
        except Exception:
            self._broken = True
            log.warning("stepscope: torchtitan's records are no longer handled", exc_info=True)

    def close(self) -> None:
        """Close the profiler with the handler (logging.shutdown() closes it at exit)."""
        super().close()
        if not self._profiling:
            return
        self._profiling = False
        if self._error is None:
            self.profiler.close()
        else:  # a failed step ends the training: the job and this process failed
            self.profiler.__exit__(StepFailed, StepFailed(self._error), None)

    def _step_start(self, record: logging.LogRecord) -> None:
        step: int | None = getattr(record, "step", None)
        if not self._seen_step:
            self._seen_step = True
            relative_step = self._relative_step()
            if step is not None and relative_step is not None and relative_step != step:
                self.profiler.resumed_from(step)  # the first step after a checkpoint's load
        self._step_failed = False
        self.profiler.begin_step(step)

    def _step_error(self, record: logging.LogRecord) -> None:
        self._step_failed = True
        self._error = record.getMessage().partition("step_error: ")[2]

    def _step_end(self, record: logging.LogRecord) -> None:
        self.profiler.end_step(failed=self._step_failed)

    def _batch_fetched(self, record: logging.LogRecord) -> None:
        waited_s = float(vars(record)["value"]) / 1000  # the span's own timing, in ms
        self.profiler.record_data_wait(waited_s, started_at=time.perf_counter() - waited_s)

    def _scalar(self, record: logging.LogRecord) -> None:
        if getattr(record, "event_name", None) == TOKENS_SCALAR:
            self.profiler.record(tokens=int(vars(record)["value"]))

    def _phase_start(self, name: str) -> Callable[[logging.LogRecord], None]:
        """An action that enters phase `name`."""

        def enter(_record: logging.LogRecord) -> None:
            phase = self.profiler.phase(name)
            phase.__enter__()
            self._phases.append(phase)

        return enter

    def _phase_end(self, record: logging.LogRecord) -> None:
        if self._phases:
            self._phases.pop().__exit__(None, None, None)


def _section_start(profiler: Profiler, name: str) -> Callable[[logging.LogRecord], None]:
    """An action that opens section `name`."""
    return lambda _record: profiler.begin_section(name)


def _section_end(profiler: Profiler, name: str) -> Callable[[logging.LogRecord], None]:
    """An action that closes section `name`."""
    return lambda _record: profiler.end_section(name)


def register_handler(
    *, structured_logger: logging.Logger, rank: int, source: str, output_dir: str, **_: Any
) -> None:
    """torchtitan's handler factory: this process's profiler takes its steps from the records."""
    # rank, source and output_dir are torchtitan's; the profiler reads its own from the env.
    try:
        profiler = claim_profiler("torchtitan")
        if not profiler.enabled:
            return
        from torchtitan.observability.structured_logger.step_state import get_relative_step

        structured_logger.addHandler(StepscopeHandler(profiler, get_relative_step))
    except Exception:
        log.warning("stepscope: no handler on torchtitan's structured logger", exc_info=True)
