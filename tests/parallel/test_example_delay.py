"""The transformer examples' injected delay: --delay-s, or --delay-step-ratio times the
rank's median step before the delay when that is longer (tests/parallel relies on it to keep
a delayed rank as visible on a slow machine)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import transformer  # noqa: E402


def delays(
    argv: list[str], rank: int, step_s: list[float], monkeypatch: pytest.MonkeyPatch
) -> list[float]:
    """The delay of each step when step i lasts step_s[i] seconds."""
    clock_s = iter(itertools.accumulate([0.0, *step_s]))
    monkeypatch.setattr(transformer.time, "perf_counter", lambda: next(clock_s))
    parser = transformer.argparse.ArgumentParser()
    transformer.add_common_args(parser)
    at = transformer.delay_for(parser.parse_args(argv), rank)
    return [at(step) for step in range(len(step_s))]


STEP_S = [5.0, 1.0, 3.0, 1.0, 1.2, 9.0, 9.0, 9.0]
"""Step 0 (start-up) and the delayed steps 5-7 are left out: the median of steps 1-4 is 1.1."""


def test_the_delay_is_the_step_ratio_of_the_median_step_before_it_when_that_is_longer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["--delay-rank", "1", "--delay-s", "0.5", "--delay-from-step", "5"]
    ratio = ["--delay-step-ratio", "2"]
    want = [0, 0, 0, 0, 0, 2.2, 2.2, 2.2]
    assert delays([*argv, *ratio], 1, STEP_S, monkeypatch) == pytest.approx(want)
    assert delays(argv, 1, STEP_S, monkeypatch) == [0, 0, 0, 0, 0, 0.5, 0.5, 0.5]
    assert delays([*argv, "--delay-step-ratio", "0.1"], 1, STEP_S, monkeypatch)[5:] == [0.5] * 3
    assert delays([*argv, *ratio], 0, STEP_S, monkeypatch) == [0.0] * len(STEP_S)
