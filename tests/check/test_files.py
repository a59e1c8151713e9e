"""Collectives files of `analyze --collectives`: old files (no per-group columns) and new."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from stepscope import schema
from stepscope.check.files import StepsFileError, scan_collectives_file
from stepscope.synthetic.generate import JobSpec, generate, to_frames

PER_GROUP = ("group", "wait_s", "first_seq", "mesh_dim", "group_ranks")


def collectives() -> pl.DataFrame:
    return to_frames(generate(JobSpec(num_ranks=2, num_steps=3, with_gpu=False)))["collectives"]


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_an_old_collectives_file_loads_in_the_default_group_with_nulls(
    tmp_path: Path, suffix: str
) -> None:
    old = collectives().drop(*PER_GROUP, strict=False)
    path = tmp_path / f"old{suffix}"
    old.write_parquet(path) if suffix == ".parquet" else old.write_csv(path)

    loaded = scan_collectives_file(path).collect()

    assert set(loaded.columns) == set(schema.COLLECTIVES.names)
    assert loaded["group"].to_list() == [schema.DEFAULT_GROUP] * 6
    assert loaded.select(PER_GROUP[1:]).null_count().row(0) == (6, 6, 6, 6)
    assert loaded.schema["first_seq"] == pl.Int64
    assert loaded.schema["wait_s"] == pl.Float64
    assert loaded["busy_s"].to_list() == pytest.approx(old["busy_s"].to_list())


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_a_new_collectives_file_keeps_its_groups_as_strings(tmp_path: Path, suffix: str) -> None:
    new = collectives().with_columns(pl.lit("tp").alias("mesh_dim"))
    path = tmp_path / f"new{suffix}"
    new.write_parquet(path) if suffix == ".parquet" else new.write_csv(path)

    loaded = scan_collectives_file(path).collect()

    assert loaded["group"].to_list() == ["0"] * 6  # "0", not the number 0
    assert loaded["first_seq"].to_list() == [0, 25, 50] * 2
    assert loaded["mesh_dim"].to_list() == ["tp"] * 6
    assert loaded["group_ranks"].to_list() == ["0-1"] * 6
    assert loaded["wait_s"].to_list() == pytest.approx(new["wait_s"].to_list())


def test_a_missing_or_unreadable_collectives_file_is_said(tmp_path: Path) -> None:
    with pytest.raises(StepsFileError, match="no such file"):
        scan_collectives_file(tmp_path / "none.parquet")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(StepsFileError, match="cannot read"):
        scan_collectives_file(junk)
