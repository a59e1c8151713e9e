"""Zero-code against hand instrumentation: the same example, with one rank slowed, run under
torchrun twice against one collector (hand-instrumented, then unmodified under `stepscope run`
with --no-stepscope) is analysed alike and measured alike.

Each case is a DDP or FSDP2 example on 4 ranks (gloo, CPU) with one rank slowed from step
DELAY_FROM_STEP on: in forward (a compute straggler) or in its DataLoader (a data straggler).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from stepscope.analysis import AnalysisConfig, analyze
from stepscope.schema import Finding
from stepscope.store.engine import make_engine
from stepscope.store.frames import read_frame
from tests.live_server import RunningServer, read_rows, run_server
from tests.profiler.test_ddp_torchrun import steps_by_rank
from tests.support import require_torchrun

pytestmark = pytest.mark.torchrun

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
STEPS = 32
DELAY_FROM_STEP = 16
"""After the warm-up, 13 steps at the ranks' own level, then 16 delayed: the analysis looks
for a shift with min_steps steps or more on either side (with fewer clean steps it may date
the straggler from the warm-up's end)."""
ANALYSIS = AnalysisConfig(
    warmup_steps=3,
    window_steps=20,
    min_steps=10,
    min_effect=0.25,
    min_offset=0.25,
    distinct_offset=0.5,
    node_share=0.99,
)
"""Shorter than the defaults (20 warm-up steps, 30 slow steps in a 50-step window) so that a
case is two short launches; only slowdowns of 25 % and more are reported. All ranks share one
node: a straggler_node only when all are flagged (at the default half, the delayed rank and
two ranks slowed by noise, see `stragglers`, were seen reported as one "compute" node)."""
STRAGGLER_KINDS = {"straggler_rank", "straggler_node", "gpu_throttling"}
FLUSH_INTERVAL_S = 2.0
"""Both modes ship as often (the examples' --flush-interval-s is 0.5 s, zero-code's default
2 s): shipping competes with training for the 2 cores."""
Mode = Literal["hand", "zero_code"]


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    example: str
    argv: tuple[str, ...]
    """The example's shape flags."""
    delay_rank: int
    delay_phase: Literal["forward", "data"]
    delay_s: float
    """About 10-20 times a clean step here (DDP ~8 ms, FSDP2 ~50 ms): 5 % of a delayed step is
    about a clean step, more than two runs' medians differ by on 2 shared cores (at a 0.1 s
    delay, DDP's were seen 5.5 % apart)."""

    @property
    def cause(self) -> str:
        return "data" if self.delay_phase == "data" else "compute"

    @property
    def first_delayed_step(self) -> int:
        """The transformer examples arm a data delay after drawing a step's batch: it slows
        the next step's (examples/transformer.py, TokenBatches)."""
        late = self.delay_phase == "data" and self.example == "fsdp2_train"
        return DELAY_FROM_STEP + late

    def argv_of(self, mode: Mode) -> list[str]:
        return [
            str(REPO / "examples" / f"{self.example}.py"),
            *self.argv,
            *("--steps", str(STEPS), "--delay-from-step", str(DELAY_FROM_STEP)),
            *("--delay-rank", str(self.delay_rank), "--delay-phase", self.delay_phase),
            *("--delay-s", str(self.delay_s)),
            *(["--no-stepscope"] if mode == "zero_code" else []),
            *("--flush-interval-s", str(FLUSH_INTERVAL_S)),
        ]


DDP = ("--width", "64")
"""An MLP step of a few ms."""
FSDP2 = ("--num-layers", "1")
"""One block: the fewest all-gathers, whose waits on 2 shared cores are the noisiest part."""
CASES = [
    Case("ddp-forward", "ddp_train", DDP, 1, "forward", 0.2),
    Case("ddp-data", "ddp_train", DDP, 2, "data", 0.2),
    Case("fsdp2-forward", "fsdp2_train", FSDP2, 1, "forward", 0.5),
    Case("fsdp2-data", "fsdp2_train", FSDP2, 2, "data", 0.5),
]


@dataclass(frozen=True, slots=True)
class Runs:
    """A case's two jobs on one collector."""

    case: Case
    db_url: str

    def job_id(self, mode: Mode) -> str:
        return f"{self.case.name}-{mode}"

    def steps(self, mode: Mode) -> dict[int, list[dict[str, Any]]]:
        return steps_by_rank(self.db_url, self.job_id(mode))

    def findings(self, mode: Mode) -> list[Finding]:
        """stepscope.analysis.analyze of the job's stored frames."""
        job_id = self.job_id(mode)
        engine = make_engine(self.db_url)
        try:
            frames = {t: read_frame(engine, t, job_id) for t in ("steps", "collectives", "ranks")}
        finally:
            engine.dispose()
        [job] = read_rows(self.db_url, "jobs", job_id)
        return analyze(
            frames["steps"],
            collectives=frames["collectives"],
            ranks=frames["ranks"],
            job=job,
            config=ANALYSIS,
        )


def torchrun(argv: Sequence[str], *, env: dict[str, str], launcher: Sequence[str] = ()) -> None:
    """Run an example on WORLD ranks under torchrun (under `launcher` when given)."""
    cmd = [*launcher, require_torchrun(), "--standalone", f"--nproc_per_node={WORLD}", *argv]
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server() as running:
        yield running


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def runs(request: pytest.FixtureRequest, server: RunningServer) -> Runs:
    """The case hand-instrumented, then unmodified under `stepscope run`."""
    case: Case = request.param
    found = Runs(case, server.db_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    env["OMP_NUM_THREADS"] = "1"
    env["STEPSCOPE_FLUSH_INTERVAL_S"] = str(FLUSH_INTERVAL_S)
    hand = {"STEPSCOPE_URL": server.url, "STEPSCOPE_JOB_ID": found.job_id("hand")}
    torchrun(case.argv_of("hand"), env={**env, **hand})
    run = [sys.executable, "-m", "stepscope.cli", "run", "--url", server.url]
    run += ["--job-id", found.job_id("zero_code"), "--"]
    torchrun(case.argv_of("zero_code"), env=env, launcher=run)
    return found


def stragglers(findings: list[Finding], min_excess_s: float) -> list[tuple[str, list[int], str]]:
    """(kind, ranks, cause) of the straggler findings that made steps at least `min_excess_s`
    longer. 4 ranks on 2 busy cores can make another rank's few-ms compute slower for real
    (seen here and in CI by tests/parallel), which is not what the test controls."""
    return [
        (f.kind, f.ranks, str(f.cause))
        for f in findings
        if f.kind in STRAGGLER_KINDS and (f.observed or 0.0) - (f.expected or 0.0) >= min_excess_s
    ]


def test_zero_code_names_the_same_straggler_and_cause_as_hand_instrumentation(
    runs: Runs,
) -> None:
    case = runs.case
    want = [("straggler_rank", [case.delay_rank], case.cause)]
    for mode in ("hand", "zero_code"):
        findings = runs.findings(mode)
        seen = [(f.kind, f.ranks, f.cause, f.first_step, f.observed, f.expected) for f in findings]
        assert stragglers(findings, case.delay_s / 4) == want, (mode, seen)


def test_zero_code_infers_every_step_by_its_optimizer_update(runs: Runs) -> None:
    hand, zero_code = runs.steps("hand"), runs.steps("zero_code")
    assert sorted(zero_code) == sorted(hand) == list(range(WORLD))
    for rank in range(WORLD):
        assert [r["step"] for r in zero_code[rank]] == list(range(STEPS)), rank
        assert [r["step"] for r in hand[rank]] == list(range(STEPS)), rank
        assert {r["step_rule"] for r in zero_code[rank]} == {"optimizer"}, rank


def medians(rows: list[dict[str, Any]], first_step: int, last_step: int) -> dict[str, float]:
    """Median step_s, data_s and comm_wait_s of the steps first_step..last_step."""
    kept = [r for r in rows if first_step <= r["step"] <= last_step]
    return {c: statistics.median(r[c] for r in kept) for c in ("step_s", "data_s", "comm_wait_s")}


STEP_TOLERANCE = 0.05
"""A rank's median step time within 5 % of hand instrumentation's: the delay makes most of a
delayed step, and every rank's step waits for it."""
WAIT_TOLERANCE = 0.10
"""A rank's median data and communication wait within 10 % of the case's delay_s, the time
the delay injects per step: what the test controls. The delay shows as the slow loader's
data_s or its peers' comm_wait_s, so a parity bug (the delay counted as compute, a wait not
measured) moves a median by about all of it. The rest is noise of 4 ranks on 2 busy cores,
bounded by the same 10 %: a clean loader's ~0.1 ms, and the slowed rank's own comm_wait_s,
which nobody waits for in it (pure transfer and its peers' turns on a core; DDP's seen at
2.25 ms zero-code and 8.42 ms by hand; FSDP2's 30-45 ms, 10.5 ms apart)."""


def test_zero_code_measures_each_rank_as_hand_instrumentation_does(runs: Runs) -> None:
    hand, zero_code = runs.steps("hand"), runs.steps("zero_code")
    first = runs.case.first_delayed_step
    table = {
        (rank, mode): medians(steps[rank], first, STEPS - 1)
        for rank in range(WORLD)
        for mode, steps in (("hand", hand), ("zero_code", zero_code))
    }
    shown = "\n".join(
        f"rank {rank} {mode:9}: " + "  ".join(f"{c} {v * 1e3:7.2f} ms" for c, v in row.items())
        for (rank, mode), row in table.items()
    )
    wait_tolerance_s = WAIT_TOLERANCE * runs.case.delay_s
    for rank in range(WORLD):
        by_hand, by_zero_code = table[rank, "hand"], table[rank, "zero_code"]
        for column, want in by_hand.items():
            tolerance_s = STEP_TOLERANCE * want if column == "step_s" else wait_tolerance_s
            assert abs(by_zero_code[column] - want) <= tolerance_s, (
                f"rank {rank} {column}: {by_zero_code[column] * 1e3:.2f} ms zero-code, "
                f"{want * 1e3:.2f} ms by hand (± {tolerance_s * 1e3:.2f} ms)\n{shown}"
            )
