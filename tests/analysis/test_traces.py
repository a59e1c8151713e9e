"""A torch.profiler trace's summary (#21): operators by total time, the training loop's own
frames left out, two ranks side by side."""

from __future__ import annotations

from typing import Any

import pytest

from stepscope.analysis.captures.traces import TOP_OPERATORS, compare_summaries, summarize_trace


def x(name: str, cat: str, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def test_frames_enclosing_a_step_are_left_out_and_times_are_seconds() -> None:
    doc = {
        "traceEvents": [
            x("train.py(10): main", "python_function", 0, 10_000),  # encloses both steps
            x("ProfilerStep#7", "user_annotation", 100, 4_000),
            x("ProfilerStep#8", "user_annotation", 4_100, 4_000),
            x("train.py(20): train_step", "python_function", 150, 3_000),
            x("train.py(20): train_step", "python_function", 4_150, 3_500),
            x("aten::mm", "cpu_op", 200, 1_000),
            x("cudaLaunchKernel", "cuda_runtime", 300, 5),
            {"ph": "M", "name": "thread_name", "args": {}},
            {"ph": "X", "name": "no times"},
        ]
    }
    summary = summarize_trace(doc)
    assert summary["num_events"] == 7
    assert summary["num_steps"] == 2
    assert summary["span_s"] == pytest.approx(0.01)
    assert summary["operators"] == [
        {
            "name": "train.py(20): train_step",
            "category": "python_function",
            "count": 2,
            "total_s": pytest.approx(0.0065),
        },
        {"name": "aten::mm", "category": "cpu_op", "count": 1, "total_s": pytest.approx(0.001)},
    ]


def test_each_category_keeps_its_top_operators() -> None:
    events = [x(f"py{i}", "python_function", i, 1_000 + i) for i in range(TOP_OPERATORS + 5)]
    events.append(x("aten::small", "cpu_op", 0, 1))
    operators = summarize_trace({"traceEvents": events})["operators"]
    names = [op["name"] for op in operators]
    assert len(names) == TOP_OPERATORS + 1
    assert "aten::small" in names
    assert f"py{TOP_OPERATORS + 4}" == names[0]
    assert "py0" not in names


def test_two_ranks_side_by_side_largest_difference_first() -> None:
    def summary(**times_s: float) -> dict[str, Any]:
        return {
            "operators": [
                {"name": n, "category": "cpu_op", "count": 1, "total_s": t}
                for n, t in times_s.items()
            ]
        }

    rows = compare_summaries(summary(mm=0.5, slow=0.3), summary(mm=0.45, wait=0.2))
    assert [(r["name"], r["difference_s"]) for r in rows] == [
        ("slow", pytest.approx(0.3)),
        ("wait", pytest.approx(-0.2)),
        ("mm", pytest.approx(0.05)),
    ]
    assert rows[0]["reference_s"] == 0.0
    assert compare_summaries(None, None) == []
