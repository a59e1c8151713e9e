"""Deep captures (#21): a torch.profiler trace's top operators, and two ranks side by side."""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

TOP_OPERATORS = 25
"""Operators kept in a trace's summary per category, by total time."""
SUMMARY_CATEGORIES = frozenset(
    {"cpu_op", "user_annotation", "python_function", "kernel", "gpu_memcpy", "gpu_memset"}
)
"""Chrome-trace event categories a summary counts: operators, annotations, Python functions
(with_stack) and device work; runtime calls and the profiler's own steps are left out."""
_SKIPPED_PREFIXES = ("ProfilerStep#", "<built-in method ", "torch/profiler/")


def summarize_trace(doc: dict[str, Any]) -> dict[str, Any]:
    """The trace's operators by total inclusive time (the top TOP_OPERATORS of each category:
    operators, annotations, Python functions, kernels), its span and counts.

    Each operator: {"name", "category", "count", "total_s"}. Times in the trace are in
    microseconds (the Chrome trace format); the summary's are seconds. Python functions
    that enclose a whole step (ProfilerStep#N), the training loop and its callers, are left
    out: they would top every list with the length of the capture.
    """
    events = [
        e
        for e in doc.get("traceEvents", ())
        if isinstance(e, dict)
        and e.get("ph") == "X"
        and isinstance(e.get("ts"), int | float)
        and isinstance(e.get("dur"), int | float)
    ]
    steps = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if str(e.get("name", "")).startswith("ProfilerStep#")
    )
    step_starts = [start for start, _ in steps]
    total_us: dict[tuple[str, str], float] = defaultdict(float)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    start_us, end_us = float("inf"), float("-inf")
    for event in events:
        ts, dur = float(event["ts"]), float(event["dur"])
        start_us, end_us = min(start_us, ts), max(end_us, ts + dur)
        category, name = event.get("cat"), event.get("name")
        if category not in SUMMARY_CATEGORIES or not isinstance(name, str):
            continue
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        if category == "python_function" and _encloses_a_step(ts, ts + dur, steps, step_starts):
            continue
        key = (name, str(category))
        total_us[key] += float(dur)
        counts[key] += 1
    ranked = sorted(total_us.items(), key=lambda item: -item[1])
    kept: dict[str, int] = defaultdict(int)
    top = []
    for (name, category), us in ranked:
        if kept[category] < TOP_OPERATORS:
            kept[category] += 1
            top.append(((name, category), us))
    return {
        "num_events": len(events),
        "num_steps": len(steps),
        "span_s": (end_us - start_us) / 1e6 if events else 0.0,
        "operators": [
            {"name": name, "category": cat, "count": counts[(name, cat)], "total_s": us / 1e6}
            for (name, cat), us in top
        ],
    }


def _encloses_a_step(
    start: float, end: float, steps: list[tuple[float, float]], step_starts: list[float]
) -> bool:
    """[start, end] holds the whole of the first step that starts in it."""
    index = bisect.bisect_left(step_starts, start)
    return index < len(steps) and steps[index][1] <= end


def compare_summaries(
    culprit: dict[str, Any] | None, reference: dict[str, Any] | None, *, top: int = 20
) -> list[dict[str, Any]]:
    """Operators of either summary side by side, largest difference (culprit − reference)
    first: {"name", "category", "culprit_s", "reference_s", "difference_s"}; an operator
    absent from one side's top list counts 0 there."""
    sides: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for index, summary in enumerate((culprit, reference)):
        for op in (summary or {}).get("operators", ()):
            sides[(op["name"], op["category"])][index] += float(op["total_s"])
    rows: list[dict[str, Any]] = [
        {
            "name": name,
            "category": category,
            "culprit_s": times[0],
            "reference_s": times[1],
            "difference_s": times[0] - times[1],
        }
        for (name, category), times in sides.items()
    ]
    rows.sort(key=lambda row: -abs(float(row["difference_s"])))
    return rows[:top]
