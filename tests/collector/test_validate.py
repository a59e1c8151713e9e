"""Column rules of a wire batch, on short columns (plain Python) and long ones (numpy)."""

from __future__ import annotations

from typing import Any

import pytest

from stepscope.collector.validate import BatchError, parse_batch


def batch(num_rows: int, **overrides: list[Any]) -> dict[str, Any]:
    steps: dict[str, list[Any]] = {
        "step": list(range(num_rows)),
        "ts": [1.7e9 + i for i in range(num_rows)],
        "step_s": [0.5] * num_rows,
        "data_s": [0] * num_rows,  # ints in a float column are fine
        **overrides,
    }
    return {
        "schema": 1,
        "job": {"job_id": "j"},
        "source": {"rank": 2, "incarnation": "x"},
        "seq": 0,
        "steps": steps,
    }


@pytest.mark.parametrize("num_rows", [3, 1000])
def test_valid_columns_are_kept_with_floats_as_floats(num_rows: int) -> None:
    parsed = parse_batch(batch(num_rows, tokens=[None] + [7] * (num_rows - 1)))
    steps = parsed.sections["steps"]
    assert steps["data_s"] == [0.0] * num_rows
    assert all(type(v) is float for v in steps["data_s"])
    assert steps["tokens"][:2] == [None, 7]
    assert steps["rank"] == [2] * num_rows
    assert steps["job_id"] == ["j"] * num_rows


@pytest.mark.parametrize("num_rows", [3, 1000])
@pytest.mark.parametrize(
    ("column", "bad", "message"),
    [
        ("step_s", -0.1, "steps.step_s must not be negative"),
        ("step_s", float("inf"), "steps.step_s must hold finite numbers"),
        ("step_s", True, "steps.step_s must hold values of type float, found bool"),
        ("step", 2**63, "steps.step holds"),
        ("step", None, "steps.step must not contain null"),
        ("tokens", 1.5, "steps.tokens must hold values of type int, found float"),
    ],
)
def test_a_bad_value_anywhere_in_a_column_is_named(
    num_rows: int, column: str, bad: Any, message: str
) -> None:
    doc = batch(num_rows, tokens=[1] * num_rows)
    doc["steps"][column][num_rows - 1] = bad
    with pytest.raises(BatchError, match=message.replace(".", r"\.")):
        parse_batch(doc)
