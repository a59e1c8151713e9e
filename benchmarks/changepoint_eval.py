"""Change-point detection quality on synthetic throughput series, next to Apache Otava.

Two sets of series, 1% Gaussian noise, 300-2000 steps, a warm-up ramp, and single-step
stalls or periodic checkpoint stalls in about half of them:
- pure noise: any change point is a false detection (goal: <= 2% of series);
- a 2% level shift (up or down) at a random step with at least `min_segment_steps` steps
  on each side after warm-up: recall = a change point within ±5 steps (goal: >= 95%).

Apache Otava (PyPI `apache-otava`) runs in its own virtualenv (`benchmarks/.venv-otava`,
created on first use) through a small runner script, on the same post-warm-up values, so
this interpreter never imports it.

    .venv/bin/python benchmarks/changepoint_eval.py [--series 500] [--no-otava]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import textwrap
import time
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stepscope.analysis.stats.changepoints import ChangePointConfig, detect_change_points

NOISE = 0.01
SHIFT = 0.02
TOLERANCE_STEPS = 5
GOAL_FALSE_RATE = 0.02
GOAL_RECALL = 0.95
OTAVA_VENV = Path(__file__).resolve().parent / ".venv-otava"
OTAVA_PACKAGE = "apache-otava"
OTAVA_CONFIGS = {
    "otava": {"window_len": 50, "max_pvalue": 0.001, "min_magnitude": 0.0},
    "otava mm=1%": {"window_len": 50, "max_pvalue": 0.001, "min_magnitude": 0.01},
}
"""Otava's defaults (`otava analyze`), and the same with stepscope's 1% minimum effect."""

RUNNER = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from otava.analysis import compute_change_points

    series = np.load(sys.argv[1])
    configs = json.loads(sys.argv[2])
    out = {}
    for name, kwargs in configs.items():
        found, start = {}, time.perf_counter()
        for key in series.files:
            change_points, _ = compute_change_points(series[key].tolist(), **kwargs)
            found[key] = [int(cp.index) for cp in change_points]
        out[name] = {"found": found, "seconds": time.perf_counter() - start}
    json.dump(out, open(sys.argv[3], "w"))
    """
)


@dataclass(kw_only=True, slots=True)
class Case:
    key: str
    values: np.ndarray
    shift_index: int | None
    """Index where the shifted level starts; None for pure noise."""
    stalls: bool
    """Whether slow-step spikes were added."""


@dataclass(kw_only=True, slots=True)
class Score:
    false_rate: float
    false_rate_stalls: float
    """The false rate among noise series that have stalls (spikes)."""
    recall: float
    extra_rate: float
    """Share of shift series with a change point further than the tolerance from the shift."""
    seconds: float


def make_cases(num_series: int, config: ChangePointConfig, seed: int = 20240601) -> list[Case]:
    """`num_series` pure-noise series and `num_series` series with one 2% shift."""
    rng = np.random.default_rng(seed)
    cases = []
    for kind in ("noise", "shift"):
        for i in range(num_series):
            n = int(rng.integers(300, 2001))
            values = float(rng.uniform(1e4, 1e6)) * (1.0 + NOISE * rng.standard_normal(n))
            values[:10] *= np.linspace(0.4, 0.95, 10)  # warm-up ramp
            shift_index = None
            if kind == "shift":
                low = config.warmup_steps + config.min_segment_steps
                shift_index = int(rng.integers(low, n - config.min_segment_steps + 1))
                values[shift_index:] *= 1.0 + SHIFT * rng.choice([-1.0, 1.0])
            stalls = _add_stalls(values, rng)
            cases.append(
                Case(key=f"{kind}{i}", values=values, shift_index=shift_index, stalls=stalls)
            )
    return cases


def _add_stalls(values: np.ndarray, rng: np.random.Generator) -> bool:
    """Slow steps lower tokens/s: single stalls in 40% of series, checkpoints in 20%."""
    draw = rng.random()
    if draw < 0.4:
        at = rng.integers(10, values.size, size=int(rng.integers(1, 11)))
        values[at] *= rng.uniform(0.3, 0.9, size=at.size)
    elif draw < 0.6:
        period = int(rng.integers(50, 201))
        at = np.arange(period, values.size, period)
        values[at] *= rng.uniform(0.2, 0.5, size=at.size)
    return draw < 0.6


def score(cases: list[Case], found: dict[str, list[int]], seconds: float) -> Score:
    noise = [c for c in cases if c.shift_index is None]
    shifted = [c for c in cases if c.shift_index is not None]

    def near(c: Case, i: int) -> bool:
        return c.shift_index is not None and abs(i - c.shift_index) <= TOLERANCE_STEPS

    stalled = [c for c in noise if c.stalls]
    return Score(
        false_rate=sum(bool(found[c.key]) for c in noise) / len(noise),
        false_rate_stalls=sum(bool(found[c.key]) for c in stalled) / max(1, len(stalled)),
        recall=sum(any(near(c, i) for i in found[c.key]) for c in shifted) / len(shifted),
        extra_rate=sum(any(not near(c, i) for i in found[c.key]) for c in shifted) / len(shifted),
        seconds=seconds,
    )


def run_stepscope(cases: list[Case], config: ChangePointConfig) -> Score:
    start = time.perf_counter()
    found = {
        c.key: [cp.index for cp in detect_change_points(c.values, config=config)] for c in cases
    }
    return score(cases, found, time.perf_counter() - start)


def ensure_otava() -> tuple[Path | None, str]:
    """The Otava virtualenv's python, created on first use, or None and why not."""
    python = OTAVA_VENV / "bin" / "python"
    if python.exists():
        return python, "existing venv"
    print(f"creating {OTAVA_VENV} and installing {OTAVA_PACKAGE} (first run only) ...")
    try:
        venv.EnvBuilder(with_pip=True, clear=True).create(OTAVA_VENV)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", OTAVA_PACKAGE],
            check=True,
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.CalledProcessError as e:
        return None, f"pip install {OTAVA_PACKAGE} failed: {e.stderr.strip()[-500:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"could not create the Otava venv: {e}"
    return python, "new venv"


def run_otava(cases: list[Case], config: ChangePointConfig) -> tuple[dict[str, Score], str]:
    """Scores per Otava configuration (on the post-warm-up values), or none and why."""
    python, note = ensure_otava()
    if python is None:
        return {}, note
    warmup = config.warmup_steps
    with tempfile.TemporaryDirectory() as tmp:
        series_path, runner_path, out_path = (
            Path(tmp) / name for name in ("series.npz", "runner.py", "out.json")
        )
        arrays: dict[str, Any] = {c.key: c.values[warmup:] for c in cases}
        np.savez(series_path, **arrays)
        runner_path.write_text(RUNNER)
        argv = [str(python), str(runner_path), str(series_path), json.dumps(OTAVA_CONFIGS)]
        done = subprocess.run(
            [*argv, str(out_path)], capture_output=True, text=True, timeout=600, check=False
        )
        if done.returncode != 0:
            return {}, f"Otava runner failed: {done.stderr.strip()[-500:]}"
        results = json.loads(out_path.read_text())
    version = subprocess.run(
        [str(python), "-m", "pip", "show", OTAVA_PACKAGE], capture_output=True, text=True
    ).stdout
    version_line = next((ln for ln in version.splitlines() if ln.startswith("Version")), "")
    scores = {}
    for name, result in results.items():
        found = {k: [i + warmup for i in v] for k, v in result["found"].items()}
        scores[name] = score(cases, found, result["seconds"])
    return scores, f"{OTAVA_PACKAGE} {version_line.removeprefix('Version: ')} ({note})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", type=int, default=500, help="series per set (default 500)")
    parser.add_argument("--no-otava", action="store_true", help="skip the Otava comparison")
    args = parser.parse_args()

    config = ChangePointConfig()
    cases = make_cases(args.series, config)
    print(
        f"{args.series} pure-noise + {args.series} shifted series, 300-2000 steps, "
        f"noise {NOISE:.0%}, shift ±{SHIFT:.0%}, recall tolerance ±{TOLERANCE_STEPS} steps"
    )
    print(f"stepscope config: {config}")
    scores = {"stepscope": run_stepscope(cases, config)}
    if args.no_otava:
        note = "skipped (--no-otava)"
    else:
        otava_scores, note = run_otava(cases, config)
        scores.update(otava_scores)
    print(f"Otava: {note}; configs: {json.dumps(OTAVA_CONFIGS)}")

    names = list(scores)
    num_stalled = sum(c.stalls for c in cases if c.shift_index is None)
    print(f"noise series with stalls: {num_stalled} of {args.series}")
    print()
    print(f"{'':34}{'goal':>8}" + "".join(f"{n:>14}" for n in names))
    rows = [
        ("false detections (noise series)", f"<= {GOAL_FALSE_RATE:.0%}", "false_rate"),
        ("  among noise series with stalls", "", "false_rate_stalls"),
        (f"recall of 2% shift within ±{TOLERANCE_STEPS}", f">= {GOAL_RECALL:.0%}", "recall"),
        ("shift series w/ an extra detection", "", "extra_rate"),
    ]
    for label, goal, field in rows:
        cells = "".join(f"{getattr(scores[n], field):>14.1%}" for n in names)
        print(f"{label:34}{goal:>8}{cells}")
    per_series_ms = "".join(f"{scores[n].seconds / len(cases) * 1e3:>14.2f}" for n in names)
    print(f"{'time per series (ms)':34}{'':>8}{per_series_ms}")
    print(f"{'total time (s)':34}{'':>8}" + "".join(f"{scores[n].seconds:>14.2f}" for n in names))
    ours = scores["stepscope"]
    met = ours.false_rate <= GOAL_FALSE_RATE and ours.recall >= GOAL_RECALL
    print(f"\nstepscope goals {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
