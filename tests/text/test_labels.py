"""Every finding kind, cause and time component has its words: none falls back to its name."""

from __future__ import annotations

from typing import get_args

import pytest

from stepscope import schema
from stepscope.text import labels


@pytest.mark.parametrize(
    ("names", "table"),
    [
        (schema.FINDING_KINDS, labels.KINDS),
        (schema.CAUSES, labels.CAUSES),
        (schema.COMPONENTS, labels.COMPONENTS),
        (schema.HANG_CLASSES, labels.HANG_CLASSES),
    ],
)
def test_every_name_of_the_schema_has_a_label(
    names: tuple[str, ...], table: dict[str, labels.Label]
) -> None:
    assert set(table) == set(names)
    assert all(label.short and label.long for label in table.values())


def test_the_tuples_are_the_literal_types() -> None:
    assert schema.FINDING_KINDS == get_args(schema.FindingKind)
    assert schema.CAUSES == get_args(schema.Cause)
    assert schema.SEVERITIES == ("info", "warning", "critical")


def test_labels_short_and_long() -> None:
    assert labels.kind("straggler_rank") == "straggler"
    assert labels.kind("straggler_rank", long=True) == "Straggler rank"
    assert labels.component("comm_wait_s") == "comm wait"
    assert labels.component("comm_wait_s", long=True) == "waiting on collectives"
    assert labels.cause("data", long=True) == "waiting for data (the input pipeline)"
    assert labels.cause("compute", long=True) == "slower compute"
    assert labels.cause("compute", long=True, on_gpu=True) == "slower compute on its GPU"
    assert labels.cause("compute", on_gpu=True) == "compute"
    assert labels.kind("new_kind") == "new kind"  # a newer server's kind, still readable
    assert labels.throttle_reasons(0x4 | 0x40) == [
        "software power cap",
        "hardware thermal slowdown",
    ]


def test_mesh_dims_and_coordinates_have_labels() -> None:
    from stepscope.text import labels

    assert labels.mesh_dim("pp") == "stage"
    assert labels.mesh_dim("pp", long=True) == "pipeline stage"
    assert labels.mesh_dim("dp_shard") == "dp shard"
    assert labels.mesh_dim("my_dim") == "my dim"
    assert labels.mesh_coord("pp", 1) == "stage 1"
    assert labels.mesh_coord("tp", "0") == "tp 0"
    assert labels.mesh_coord("tp", None) == "tp ?"
