"""Model FLOPs and MFU: peak bf16 FLOP/s per device, FLOPs counted by torch, and the ratio."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

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


def measure_flops(fn: Callable[[], object]) -> float:
    """FLOPs torch counts while running `fn` once (forward, backward, whatever it calls)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def mfu(flops_per_step: float, step_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation (achieved FLOP/s over peak); NaN unless step_s and peak are > 0."""
    if step_s <= 0 or peak_flops <= 0:
        return math.nan
    return flops_per_step / step_s / peak_flops
