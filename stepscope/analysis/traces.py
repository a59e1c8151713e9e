"""Deep captures (#21): a torch.profiler trace's top operators, and two ranks side by side."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

TOP_OPERATORS = 40
"""Operators kept in a trace's summary, by total time."""
SUMMARY_CATEGORIES = frozenset(
    {"cpu_op", "user_annotation", "python_function", "kernel", "gpu_memcpy", "gpu_memset"}
)
"""Chrome-trace event categories a summary counts: operators, annotations, Python functions
(with_stack) and device work; runtime calls and the profiler's own steps are left out."""
_SKIPPED_PREFIXES = ("ProfilerStep#", "<built-in method ", "torch/profiler/")


def summarize_trace(doc: dict[str, Any]) -> dict[str, Any]:
    """The trace's operators by total inclusive time (top TOP_OPERATORS), its span and count.

    Each operator: {"name", "category", "count", "total_s"}. Times in the trace are in
    microseconds (the Chrome trace format); the summary's are seconds.
    """
    total_us: dict[tuple[str, str], float] = defaultdict(float)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    start_us, end_us, num_events = float("inf"), float("-inf"), 0
    for event in doc.get("traceEvents", ()):
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        ts, dur = event.get("ts"), event.get("dur")
        if not isinstance(ts, int | float) or not isinstance(dur, int | float):
            continue
        num_events += 1
        start_us, end_us = min(start_us, ts), max(end_us, ts + dur)
        category, name = event.get("cat"), event.get("name")
        if category not in SUMMARY_CATEGORIES or not isinstance(name, str):
            continue
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        key = (name, str(category))
        total_us[key] += float(dur)
        counts[key] += 1
    top = sorted(total_us.items(), key=lambda item: -item[1])[:TOP_OPERATORS]
    return {
        "num_events": num_events,
        "span_s": (end_us - start_us) / 1e6 if num_events else 0.0,
        "operators": [
            {"name": name, "category": cat, "count": counts[(name, cat)], "total_s": us / 1e6}
            for (name, cat), us in top
        ],
    }


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
