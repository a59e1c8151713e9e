"""The Hugging Face `Trainer` adapter: `StepscopeCallback` marks the Trainer's steps on this
process's profiler, by hand (`Trainer(..., callbacks=[StepscopeCallback()])`) or, under
`stepscope run`, added to every Trainer by `attach()`.

The Trainer's events give the steps (one per optimizer update, from `on_step_begin` to
`on_step_end`; gradient-accumulation micro-batches, `on_substep_end`, are parts of it) and the
`optimizer` section. It has no event for the rest, so `patch_trainer()` wraps its methods,
once a process:

- `get_batch_samples`: the time blocked fetching a step's micro-batches (the Trainer fetches
  them all before `on_step_begin`) is that step's data wait; their tokens (non-padding ones
  when an attention mask is given) and samples are its work;
- the forward of the Trainer's model (a hook on the wrapped model) and `training_step`: each
  micro-batch's `forward`, then `backward` (what follows the forward in `training_step`);
- `floating_point_ops`: the FLOPs the Trainer already estimates for each micro-batch
  (6 x input tokens x non-embedding parameters, for a Transformers model);
- `evaluate` and `predict`: an `eval` phase; `_save_checkpoint`: a `checkpoint_save` phase;
- `train`: a `train()` that raises ends its step as failed.

Nothing here raises into training: an error is logged once and the adapter turns itself off.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from transformers.trainer_callback import TrainerCallback

from stepscope.integrations.claim import claim_profiler
from stepscope.profiler import session
from stepscope.profiler.auto.patches import Patches
from stepscope.profiler.base import Profiler
from stepscope.schema import StepRule

if TYPE_CHECKING:
    from transformers.trainer_callback import TrainerControl, TrainerState
    from transformers.training_args import TrainingArguments

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

OWNER: StepRule = "transformers"
PHASES = {"evaluate": "eval", "predict": "eval", "_save_checkpoint": "checkpoint_save"}
"""Trainer methods run as a phase of the profiler."""

_patches = Patches()
_patched: list[type] = []
_running: StepscopeCallback | None = None
"""The callback marking the steps of the train() in progress; the Trainer's wraps act for it."""
_warned = False
"""An error of the adapter was logged (with its traceback) in this process."""


def _fail_open(what: str) -> Callable[[F], F]:
    """A callback method that never raises: on an error, the adapter says `what` failed (once)
    and turns itself off; the method returns None."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def call(self: StepscopeCallback, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception:
                self._turn_off(what)
                return None

        return call  # type: ignore[return-value]

    return decorate


def attach(module: ModuleType) -> None:
    """Give every Trainer of `module` (the imported `transformers.trainer`) stepscope's callback;
    idempotent, and never raises (a failure is logged once and the job runs unprofiled)."""
    try:
        if StepscopeCallback not in module.DEFAULT_CALLBACKS:
            module.DEFAULT_CALLBACKS.append(StepscopeCallback)
        patch_trainer(module.Trainer)
    except Exception:
        _warn_once("could not attach to the Hugging Face Trainer")


def patch_trainer(trainer_class: type) -> None:
    """Wrap the Trainer's methods that the callback needs (once a process)."""
    if trainer_class in _patched:
        return
    _patched.append(trainer_class)
    methods: dict[str, Callable[[Any], Any]] = {
        "get_batch_samples": _get_batch_samples,
        "training_step": _training_step,
        "floating_point_ops": _floating_point_ops,
        "train": _train,
    }
    methods.update({name: functools.partial(_in_phase, phase) for name, phase in PHASES.items()})
    for name, make in methods.items():
        if name in vars(trainer_class):  # a private one (_save_checkpoint) may go in a release
            _patches.wrap(trainer_class, name, make)


def unpatch_trainer() -> None:
    """Undo patch_trainer() (tests)."""
    _patches.undo()
    _patched.clear()


class StepscopeCallback(TrainerCallback):
    """Marks the Trainer's steps, sections and phases on this process's stepscope profiler."""

    def __init__(self) -> None:
        self.profiler: Profiler | None = None
        """The profiler while this callback marks a train()'s steps; None otherwise."""
        self._owns_profiler = False
        """This callback started the profiler (nothing profiled the process before)."""
        self._in_step = False
        self._forward_depth = 0
        self._in_backward = False
        self._model: Any = None
        """The wrapped model whose forwards are hooked (and that the profiler watches)."""
        self._hooks: list[Any] = []
        self._token_counts: list[Any] = []
        """Per micro-batch of the open step: its token count, an int or a tensor not yet read."""
        self._tokens = 0
        self._samples = 0
        self._flops = 0.0
        try:
            from transformers.trainer import Trainer

            patch_trainer(Trainer)  # passed by hand, without stepscope run's attach()
        except Exception:
            _warn_once("could not wrap the Hugging Face Trainer's methods")

    # ---- the Trainer's events --------------------------------------------------------------

    @_fail_open("could not start profiling the Trainer")
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        global _running
        if _running is not None and _running is not self:
            return  # a second StepscopeCallback in this Trainer (by hand and by stepscope run)
        if self.profiler is not None:  # train() again inside train(): auto_find_batch_size
            self._close_step(failed=True)
            return
        started = session.current() is None
        profiler = claim_profiler(OWNER)
        if not profiler.enabled:
            return
        self.profiler, self._owns_profiler = profiler, started
        _running = self
        if state.global_step > 0:
            profiler.resumed_from(state.global_step)

    @_fail_open("could not open a step")
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.profiler is not None:
            self.profiler.begin_step(state.global_step)
            self._in_step = True

    @_fail_open("could not end a micro-batch")
    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_backward()  # a gradient-accumulation micro-batch is done; the step goes on

    @_fail_open("could not open the optimizer section")
    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.profiler is not None:
            self._end_backward()
            self._read_token_counts()
            self.profiler.begin_section("optimizer")

    @_fail_open("could not close the optimizer section")
    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.profiler is not None:
            self.profiler.end_section("optimizer")

    @_fail_open("could not end a step")
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.profiler is not None:
            self._close_step(failed=False)

    @_fail_open("could not end profiling the Trainer")
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._finish(None)

    # ---- what the Trainer's wrapped methods report -----------------------------------------

    @_fail_open("could not time the Trainer's batches")
    def fetching(self, trainer: Any, batches: Iterator[Any]) -> Iterator[Any] | None:
        """The next step's micro-batch iterator, timed: its waits are that step's data wait."""
        profiler = self.profiler
        if profiler is None:
            return None
        model = trainer.model_wrapped
        if model is not self._model:
            self._observe(profiler, model)
        return iter(profiler.wrap_dataloader(batches))  # each next() is data wait

    @_fail_open("could not count the tokens of the Trainer's batches")
    def fetched(self, batches: list[Any]) -> None:
        """Count the tokens and samples of the next step's micro-batches."""
        for batch in batches:
            input_ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
            if input_ids is None:
                continue
            mask = batch.get("attention_mask")
            # A tensor, read at the optimizer step: no device sync while the step queues work.
            self._token_counts.append(input_ids.numel() if mask is None else mask.sum())
            self._samples += int(input_ids.shape[0])

    def add_flops(self, flops: float) -> None:
        """Add a micro-batch's FLOPs to the open step's."""
        if self._in_step:
            self._flops += flops

    @_fail_open("could not end a backward")
    def training_step_done(self) -> None:
        """A micro-batch's forward and backward are done."""
        self._end_backward()

    @_fail_open("could not close the profiler after a failed train()")
    def failed(self, exc: BaseException) -> None:
        """train() raised: its open step failed, and a profiler this callback started closes."""
        self._finish(exc)

    @_fail_open("could not time a forward")
    def _forward_begins(self, module: Any, args: Any) -> None:
        profiler = self.profiler
        if profiler is None or not self._in_step:
            return
        self._end_backward()
        self._forward_depth += 1
        if self._forward_depth == 1:
            profiler.begin_section("forward")

    @_fail_open("could not time a forward")
    def _forward_ends(self, module: Any, args: Any, output: Any) -> None:
        profiler = self.profiler
        if profiler is None or self._forward_depth == 0:
            return
        self._forward_depth -= 1
        if self._forward_depth == 0:
            profiler.end_section("forward")
            profiler.begin_section("backward")  # what follows in training_step: loss, backward
            self._in_backward = True

    # ---- inside --------------------------------------------------------------------------

    def _observe(self, profiler: Profiler, model: Any) -> None:
        """Watch the Trainer's wrapped model (DDP's all-reduce wait) and hook its forward."""
        self._remove_hooks()
        self._model = model
        profiler.watch(model)  # a DDP wrap the profiler did not see (it started after)
        self._hooks = [
            model.register_forward_pre_hook(self._forward_begins),
            model.register_forward_hook(self._forward_ends, always_call=True),
        ]

    def _end_backward(self) -> None:
        if self._in_backward and self.profiler is not None:
            self._in_backward = False
            self.profiler.end_section("backward")

    def _read_token_counts(self) -> None:
        if self._token_counts:
            self._tokens += int(sum(self._token_counts))
            self._token_counts.clear()

    def _close_step(self, *, failed: bool) -> None:
        """Record the open step's work and end it."""
        profiler = self.profiler
        assert profiler is not None
        self._end_backward()
        self._forward_depth = 0
        if self._in_step:
            self._read_token_counts()
            flops = {"flops": self._flops} if self._flops else {}
            profiler.record(tokens=self._tokens or None, samples=self._samples or None, **flops)
            profiler.end_step(failed=failed)
        self._in_step = False
        self._tokens = self._samples = 0
        self._flops = 0.0

    def _finish(self, exc: BaseException | None) -> None:
        """The train() ended (raising `exc`): end its step; close a profiler this started."""
        profiler = self.profiler
        if profiler is None:
            return
        self._close_step(failed=exc is not None)
        self._stop()
        if not self._owns_profiler:
            return  # zero-code's or the script's: its owner closes it
        if exc is None:
            profiler.close()
        else:  # the exception is reported with its step, and the job marked failed
            profiler.__exit__(type(exc), exc, exc.__traceback__)

    def _stop(self) -> None:
        """Mark nothing more: no profiler, no hooks, not the running callback."""
        global _running
        self.profiler = None
        self._in_step = self._in_backward = False
        self._token_counts.clear()
        self._remove_hooks()
        if _running is self:
            _running = None

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._model = None

    def _turn_off(self, what: str) -> None:
        """After an error of the adapter: log it once, and mark nothing more."""
        _warn_once(what)
        try:
            self._stop()
        except Exception:
            log.debug("stepscope: the Trainer adapter did not stop cleanly", exc_info=True)


# ---- the Trainer's wrapped methods --------------------------------------------------------


def _get_batch_samples(original: F) -> F:
    @functools.wraps(original)
    def get_batch_samples(trainer: Any, epoch_iterator: Any, *args: Any, **kwargs: Any) -> Any:
        callback = _running
        if callback is None:
            return original(trainer, epoch_iterator, *args, **kwargs)
        timed = callback.fetching(trainer, epoch_iterator)
        result = original(trainer, epoch_iterator if timed is None else timed, *args, **kwargs)
        callback.fetched(result[0])
        return result

    return get_batch_samples  # type: ignore[return-value]


def _training_step(original: F) -> F:
    @functools.wraps(original)
    def training_step(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        loss = original(trainer, *args, **kwargs)
        callback = _running
        if callback is not None:
            callback.training_step_done()
        return loss

    return training_step  # type: ignore[return-value]


def _floating_point_ops(original: F) -> F:
    @functools.wraps(original)
    def floating_point_ops(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        flops = original(trainer, *args, **kwargs)
        callback = _running
        if callback is not None and isinstance(flops, int | float):
            callback.add_flops(float(flops))
        return flops

    return floating_point_ops  # type: ignore[return-value]


def _train(original: F) -> F:
    @functools.wraps(original)
    def train(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(trainer, *args, **kwargs)
        except BaseException as exc:
            callback = _running
            if callback is not None:
                callback.failed(exc)
            raise

    return train  # type: ignore[return-value]


def _in_phase(phase: str, original: F) -> F:
    @functools.wraps(original)
    def call(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        running = session.current()
        if running is None or running.owner != OWNER:
            return original(trainer, *args, **kwargs)
        with running.profiler.phase(phase):
            return original(trainer, *args, **kwargs)

    return call  # type: ignore[return-value]


def _warn_once(what: str) -> None:
    """Log an error of the adapter (with its traceback) the first time one happens."""
    global _warned
    if _warned:
        log.debug("stepscope: %s", what, exc_info=True)
        return
    _warned = True
    log.warning("stepscope: %s; the Trainer is not profiled", what, exc_info=True)
