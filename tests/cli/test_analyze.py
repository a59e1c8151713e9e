"""`stepscope analyze --steps FILE --collectives FILE`: collectives files old and new."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stepscope.synthetic.generate import JobSpec, Straggler, generate, to_frames
from tests.cli.test_read import stepscope

PER_GROUP = ("group", "wait_s", "first_seq", "group_ranks")


def analyze_json(*args: str) -> list[dict[str, Any]]:
    done = stepscope("analyze", *args, "--format", "json")
    assert done.returncode == 0, done.stderr[-3000:]
    findings: list[dict[str, Any]] = json.loads(done.stdout)
    return findings


def _without_times(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in f.items() if k != "detected_at"} for f in findings]


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_an_old_collectives_file_is_analysed_as_the_new_one(tmp_path: Path, suffix: str) -> None:
    spec = JobSpec(
        job_id="offline",
        num_ranks=8,
        num_steps=300,
        stragglers=(Straggler(ranks=(5,), factor=1.2, cause="communication", from_step=120),),
        seed=3,
        with_gpu=False,
    )
    frames = to_frames(generate(spec))
    paths = {name: tmp_path / f"{name}{suffix}" for name in ("steps", "new", "old")}
    for name, frame in (
        ("steps", frames["steps"]),
        ("new", frames["collectives"]),
        ("old", frames["collectives"].drop(*PER_GROUP)),  # a file from before #18
    ):
        frame.write_parquet(paths[name]) if suffix == ".parquet" else frame.write_csv(paths[name])

    new = analyze_json("--steps", str(paths["steps"]), "--collectives", str(paths["new"]))
    old = analyze_json("--steps", str(paths["steps"]), "--collectives", str(paths["old"]))

    straggler = next(f for f in new if f["kind"] == "straggler_rank")
    assert (straggler["ranks"], straggler["cause"]) == ([5], "communication")
    assert _without_times(old) == _without_times(new)


def test_a_missing_collectives_file_is_said_without_a_traceback(tmp_path: Path) -> None:
    steps = tmp_path / "steps.parquet"
    to_frames(generate(JobSpec(num_ranks=2, num_steps=20, with_gpu=False)))["steps"].write_parquet(
        steps
    )
    done = stepscope("analyze", "--steps", str(steps), "--collectives", str(tmp_path / "c.csv"))
    assert done.returncode != 0
    assert "no such file" in done.stderr
    assert "Traceback" not in done.stderr
