"""`init()`: the active profiler when profiling is enabled, the no-op base otherwise.

Importing this module imports neither torch nor anything server-side: the active
profiler (stepscope.profiler.active) is loaded only when profiling is enabled.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from stepscope.profiler import session
from stepscope.profiler.base import Profiler
from stepscope.profiler.config import build_config, detect_env

log = logging.getLogger(__name__)


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

    Under zero-code (`stepscope run`) or an adapter that already started this process's
    profiler, `init` returns that profiler, whose steps are now the caller's; of the
    arguments, only the work counts and `model` apply to it.
    """
    running = session.claim("user")
    if running is not None:
        return _adopt(
            running.profiler,
            model=model,
            tokens_per_step=tokens_per_step,
            samples_per_step=samples_per_step,
            flops_per_step=flops_per_step,
        )
    profiler = build_profiler(
        job_id=job_id,
        url=url,
        token=token,
        model=model,
        tokens_per_step=tokens_per_step,
        samples_per_step=samples_per_step,
        flops_per_step=flops_per_step,
        peak_flops=peak_flops,
        benchmark_key=benchmark_key,
        attributes=attributes,
        **options,
    )
    if profiler.enabled:
        session.start(profiler, "user")
    return profiler


def current() -> Profiler:
    """This process's running profiler (zero-code's, an adapter's or init()'s) without taking
    its steps: to declare what zero-code cannot know (`resumed_from`, `record(tokens=)`,
    a `phase`); the no-op profiler when nothing profiles this process."""
    running = session.running_profiler()
    return running if running is not None else Profiler()


def build_profiler(*, model: Any = None, **options: Any) -> Profiler:
    """A new profiler for this rank (init()'s, without the session), `options` being Config
    fields: the no-op one when profiling is off or fails to start."""
    try:
        config = build_config(**options)
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
        from stepscope.profiler.active import ActiveProfiler

        return ActiveProfiler(config=config, env=env, model=model)
    except Exception:
        log.exception("stepscope disabled: the profiler failed to start")
        return Profiler()


def _adopt(
    profiler: Profiler,
    *,
    model: Any,
    tokens_per_step: int | None,
    samples_per_step: int | None,
    flops_per_step: float | Literal["auto"] | None,
) -> Profiler:
    """The running profiler, with the work counts and model an `init()` call gave."""
    from stepscope.profiler.active import ActiveProfiler  # a running profiler imported it

    if isinstance(profiler, ActiveProfiler):
        profiler.set_work_counts(
            tokens_per_step=tokens_per_step,
            samples_per_step=samples_per_step,
            flops_per_step=flops_per_step,
        )
    if model is not None:
        profiler.watch(model)
    profiler.step_rule = None  # the steps are the caller's step() blocks from now on
    log.info("stepscope: init() takes over this process's running profiler and its steps")
    return profiler
