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


def with_collectives(num_rows: int, **columns: list[Any]) -> dict[str, Any]:
    doc = batch(num_rows)
    doc["collectives"] = {
        "step": list(range(num_rows)),
        "op": ["all_reduce"] * num_rows,
        "group_size": [8] * num_rows,
        "count": [2] * num_rows,
        "bytes": [1024] * num_rows,
        "busy_s": [0.01] * num_rows,
        **columns,
    }
    return doc


@pytest.mark.parametrize("num_rows", [3, 1000])
def test_collectives_without_a_group_get_the_default_group_in_every_row(num_rows: int) -> None:
    parsed = parse_batch(with_collectives(num_rows))
    collectives = parsed.sections["collectives"]
    assert collectives["group"] == [""] * num_rows
    assert "wait_s" not in collectives


@pytest.mark.parametrize("num_rows", [3, 1000])
@pytest.mark.parametrize(
    ("column", "bad", "message"),
    [
        ("wait_s", -0.5, "collectives.wait_s must not be negative"),
        ("wait_s", float("nan"), "collectives.wait_s must hold finite numbers"),
        ("first_seq", 1.5, "collectives.first_seq must hold values of type int, found float"),
        ("group", 0, "collectives.group must hold values of type str, found int"),
        ("mesh_dim", 1, "collectives.mesh_dim must hold values of type str, found int"),
        ("group_ranks", [0, 1], "collectives.group_ranks must hold values of type str"),
    ],
)
def test_a_bad_value_in_a_per_group_column_is_named(
    num_rows: int, column: str, bad: Any, message: str
) -> None:
    good = {"wait_s": 0.0, "first_seq": 3, "group": "0", "mesh_dim": "tp", "group_ranks": "0-7"}
    doc = with_collectives(num_rows, **{column: [good[column]] * num_rows})
    doc["collectives"][column][num_rows - 1] = bad
    with pytest.raises(BatchError, match=message.replace(".", r"\.").replace("[", r"\[")):
        parse_batch(doc)


def test_a_valid_mesh_is_kept_with_the_source() -> None:
    doc = batch(1)
    doc["source"]["mesh"] = {"pp": [3, 4], "dp_shard": [0, 1]}
    assert parse_batch(doc).source["mesh"] == {"pp": [3, 4], "dp_shard": [0, 1]}
