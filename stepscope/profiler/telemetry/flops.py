"""Model FLOPs and MFU: peak bf16 FLOP/s per device, FLOPs counted by torch, and the ratio."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from types import TracebackType
from typing import Any

PEAK_BF16_FLOPS: dict[str, float] = {
    # Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, in FLOP/s.
    # Keys are case-insensitive regexes over torch.cuda.get_device_name(); the first match
    # wins, so specific variants come before the family they belong to. A variant not
    # listed matches nothing: a guessed peak is how tools end up reporting 563% MFU.
    r"\bGB200\b": 2500e12,
    r"\bB200\b": 2250e12,
    r"\bGH200\b": 989e12,
    r"\bH200 NVL\b": 835e12,
    r"\bH200\b": 989e12,
    r"\bH100 NVL\b": 835e12,
    r"\bH100 PCIe\b": 756e12,
    r"\bH100\b.*\b(HBM3|SXM5?)\b": 989e12,
    r"\bA100\b": 312e12,
    r"\bA40\b": 149.7e12,
    r"\bA10\b": 125e12,
    r"\bL40S\b": 362e12,
    r"\bL4\b": 121e12,
    r"\bRTX 4090\b": 165.2e12,
    r"\bMI325X\b": 1307e12,
    r"\bMI300X\b": 1307e12,
    r"\bMI250X\b": 383e12,
}
"""Peak dense bf16 FLOP/s per device, keyed by device-name pattern (first match wins)."""

_PATTERNS = [
    (re.compile(pattern, re.IGNORECASE), peak) for pattern, peak in PEAK_BF16_FLOPS.items()
]


def peak_flops_for(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a torch.cuda.get_device_name() string; None if unknown."""
    for pattern, peak in _PATTERNS:
        if pattern.search(device_name):
            return peak
    return None


class RankFlopCounter:
    """Counts the model FLOPs this rank executes while entered, as torch's FlopCounterMode does,
    with three corrections so that MFU stays right under TP and on any attention kernel:

    - DTensor ops (tensor parallelism) are counted at the shapes of the local shards each rank
      multiplies, not at the global shapes FlopCounterMode sees at the DTensor level (which
      counts every TP rank as doing the whole matmul).
    - Ops on FakeTensors, which DTensor's sharding propagation runs on a cache miss to learn
      output shapes, do no arithmetic and are not counted.
    - Fused attention is counted as model FLOPs: the CPU kernel (which FlopCounterMode does not
      know, so counts as 0) is counted, and backward is twice forward, without the recompute of
      Q·Kᵀ that FlopCounterMode adds for the fused kernels (MFU excludes recomputation).

    FSDP and DDP need no correction: their all-gathers, reduce-scatters and all-reduces are not
    matmuls, and each rank computes its own batch on unsharded parameters. Not corrected: a
    causal mask's skipped half of attention is counted (as FlopCounterMode and torchtitan do),
    and so is the forward that activation checkpointing recomputes.
    """

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self._counter = FlopCounterMode(display=False, custom_mapping=_model_flop_formulas())
        self._local_shapes = _local_shapes_mode()()

    def __enter__(self) -> RankFlopCounter:
        self._counter.__enter__()
        # Entered last, so it sees each op first and can hand DTensor ops to DTensor.
        self._local_shapes.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._local_shapes.__exit__(exc_type, exc, tb)
        finally:
            self._counter.__exit__(exc_type, exc, tb)

    def get_total_flops(self) -> int:
        """FLOPs counted so far (the total once exited)."""
        return int(self._counter.get_total_flops())


@functools.cache
def _local_shapes_mode() -> type:
    """A dispatch mode that declines DTensor ops, so that DTensor runs them on its local shards
    and those local ops (plain tensors) come back through the mode stack to be counted."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    dtensor: tuple[type, ...] = ()
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        dtensor = (DTensor,)

    class LocalShapes(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if any(issubclass(t, dtensor) for t in types):
                return NotImplemented
            return func(*args, **(kwargs or {}))

    return LocalShapes


def _model_flop_formulas() -> dict[Any, Any]:
    """FlopCounterMode's formulas with the attention corrections, each counting nothing on
    FakeTensors; all take the op's raw arguments (custom_mapping's `_get_raw`)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    formulas: dict[Any, Callable[..., int]] = dict(flop_registry)
    formulas[aten._scaled_dot_product_flash_attention_for_cpu] = _attention_forward_flops
    for backward in (
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_cudnn_attention_backward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
    ):
        formulas[backward] = _attention_backward_flops

    def executed_only(formula: Callable[..., int]) -> Callable[..., int]:
        def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
            if any(isinstance(leaf, FakeTensor) for leaf in tree_leaves((args, kwargs))):
                return 0
            return formula(*args, out_val=out_val, **kwargs)

        count._get_raw = True  # type: ignore[attr-defined]
        return count

    return {op: executed_only(formula) for op, formula in formulas.items()}


def _attention_forward_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    """Q·Kᵀ and P·V, over all query heads (grouped K/V heads are broadcast); mask ignored."""
    batch, num_heads, seq_q, head_dim_qk = query.shape
    seq_k, head_dim_v = key.shape[-2], value.shape[-1]
    return 2 * batch * num_heads * seq_q * seq_k * (head_dim_qk + head_dim_v)


def _attention_backward_flops(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    """dV, dP, dQ and dK: twice the forward."""
    return 2 * _attention_forward_flops(query, key, value)


def measure_flops(fn: Callable[[], object]) -> float:
    """Model FLOPs this rank executes while running `fn` once (forward, backward, whatever it
    calls); see RankFlopCounter for what is counted."""
    with RankFlopCounter() as counter:
        fn()
    return float(counter.get_total_flops())


def mfu(flops_per_step: float, step_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation (achieved FLOP/s over peak); NaN unless step_s and peak are > 0."""
    if step_s <= 0 or peak_flops <= 0:
        return math.nan
    return flops_per_step / step_s / peak_flops
