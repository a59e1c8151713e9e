"""The training-side API: `init()` and the `Profiler` interface, whose base class is a no-op.

Importing this module imports neither torch nor anything server-side: the active
profiler (stepscope.profiler.core) is loaded only when profiling is enabled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Literal, TypeVar

from .config import build_config, detect_env

log = logging.getLogger(__name__)

T = TypeVar("T")


class _NullContext:
    """A reusable context manager that does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


NULL_CONTEXT = _NullContext()


class Profiler:
    """Profiles one training rank. This base class is the no-op used when disabled."""

    enabled = False

    def step(self, step: int | None = None) -> Any:
        """Context manager around one training step (step_s; steps count from 0 unless given)."""
        return NULL_CONTEXT

    def section(self, name: str) -> Any:
        """Context manager timing a part of the step: forward, backward, optimizer, h2d, or any."""
        return NULL_CONTEXT

    def wrap_dataloader(self, loader: Iterable[T]) -> Iterable[T]:
        """The loader, iterating as before, with the time blocked in next() counted as data_s."""
        return loader

    def watch(self, model: Any) -> None:
        """Time a DistributedDataParallel model's gradient all-reduces (Config.comm_timing)."""

    def record(
        self, *, tokens: int | None = None, samples: int | None = None, **custom: Any
    ) -> None:
        """Attach work counts (and any other values) to the current step."""

    def event(self, kind: str, message: str, **attributes: Any) -> None:
        """Send an event (kind one of schema.EVENT_KINDS) to the collector."""

    def measure_flops(self, fn: Callable[[], object]) -> float | None:
        """Count the FLOPs of `fn()` (e.g. one forward+backward) and use them as flops per step."""
        return None

    def close(self) -> None:
        """Flush what is buffered (bounded by close_timeout_s) and stop profiling."""

    def __enter__(self) -> Profiler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        self.close()
        return False


def init(
    *,
    job_id: str | None = None,
    url: str | None = None,
    token: str | None = None,
    model: Any = None,
    tokens_per_step: int | None = None,
    samples_per_step: int | None = None,
    flops_per_step: float | Literal["auto"] | None = None,
    peak_flops: float | None = None,
    benchmark_key: str | None = None,
    attributes: dict[str, Any] | None = None,
    **options: Any,
) -> Profiler:
    """Start profiling this rank; a no-op Profiler when disabled, without a URL, or on error.

    Every argument can also come from a STEPSCOPE_<NAME> environment variable
    (STEPSCOPE_URL, STEPSCOPE_TOKEN, STEPSCOPE_JOB_ID, STEPSCOPE_DISABLED, ...); explicit
    arguments win. `options` are further Config fields (flush_interval_s, spill_dir, ...).
    """
    try:
        config = build_config(
            job_id=job_id,
            url=url,
            token=token,
            tokens_per_step=tokens_per_step,
            samples_per_step=samples_per_step,
            flops_per_step=flops_per_step,
            peak_flops=peak_flops,
            benchmark_key=benchmark_key,
            attributes=attributes,
            **options,
        )
    except (TypeError, ValueError) as exc:
        log.error("stepscope disabled: bad configuration: %s", exc)
        return Profiler()
    if not config.enabled:
        if not config.disabled:
            log.info("stepscope disabled: no collector URL (set STEPSCOPE_URL or pass url=)")
        return Profiler()
    env = detect_env()
    if config.job_id is None:
        if env.job_id is None and env.world_size > 1:
            log.error(
                "stepscope disabled: no job id; pass job_id= or set STEPSCOPE_JOB_ID "
                "(all ranks must agree, torchrun and Slurm provide one)"
            )
            return Profiler()
        config.job_id = env.job_id
    try:
        from .core import ActiveProfiler

        return ActiveProfiler(config=config, env=env, model=model)
    except Exception:
        log.exception("stepscope disabled: the profiler failed to start")
        return Profiler()
