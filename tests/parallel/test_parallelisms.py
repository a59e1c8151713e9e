"""Every parallelism under torchrun + gloo with the profiler on: the training is unchanged
(bit-identical losses), the stored collectives are the ones the model must issue, a delayed
rank is named as the straggler, and a failure inside the collective tap only turns it off.

One torchrun launch (tests/parallel/ranks.py) runs all cases on 4 ranks, one after the other;
each case is three runs on every rank: without stepscope, profiled with one rank delayed, and
profiled with the tap made to raise.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from stepscope.analysis import AnalysisConfig, analyze
from stepscope.schema import Finding, compact_ranks, group_label
from stepscope.store.engine import make_engine
from stepscope.store.frames import read_frame
from tests.live_server import RunningServer, read_rows, run_server
from tests.parallel import expected as ex
from tests.support import require_torchrun

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
RANKS_SCRIPT = REPO / "tests" / "parallel" / "ranks.py"
WORLD = 4
STEPS = 40
ANALYSIS = AnalysisConfig(
    warmup_steps=5,
    window_steps=20,
    min_steps=10,
    min_effect=0.25,
    min_offset=0.25,
    distinct_offset=0.5,
)
"""Shorter than the defaults (20 warm-up steps, a rank slow for 30 steps of a 50-step window)
so that nine cases fit one short launch; the delay starts after the warm-up. Only slowdowns
of 25 % and more are reported: the injected delay makes its rank's compute several times its
peers', while 4 ranks sharing 2 busy cores can make another rank's a few percent slower for
real (seen in CI: 7 %), which is not what these tests control."""
DELAY_FROM_STEP = 16
"""After the warm-up, 11 steps at the rank's own level: the straggler test looks for a shift
with 10 steps or more on either side."""
DELAY_S = 0.2
DELAY_STEP_RATIO = 1.0
"""Steps of these tiny models take 0.1-0.3 s on 2 cores shared by 4 ranks: a delay well above
their noise. A slower machine (CI's has run Python 4-5 times slower) makes the steps slower
and noisier; the delay, at least a step's time, stays as far above the noise."""
BROKEN_STEPS = 8
CFG = ex.ModelConfig()
BATCH_SIZE = 8
MICROBATCHES = 4
DDP_WIDTH = 64
STRAGGLER_KINDS = {"straggler_rank", "straggler_node", "gpu_throttling"}
TAP_BREAK_TARGET = "stepscope.profiler.collectives.tap:CollectiveCall"
"""What the tap calls for every collective it records; made to raise in the broken runs."""
DDP_BREAK_TARGET = "stepscope.profiler.collectives.ddp:CollectiveCall"
"""DDP's all-reduces bypass the tap (C++ reducer): its step timer records them with this."""


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    example: str
    argv: tuple[str, ...]
    delay_rank: int
    delay_phase: str
    layout: ex.Layout = field(default_factory=ex.Layout)
    delay_s: float = DELAY_S
    stage_named: bool = False
    """A pipeline: the finding names the delayed rank's stage, and its world group is "pp"
    (watch(PipelineStage) labels it)."""
    break_target: str = TAP_BREAK_TARGET

    def expected(self, rank: int) -> ex.Expected:
        if self.example == "ddp_train":
            return ex.data_parallel(DDP_WIDTH, self.argv[self.argv.index("--mode") + 1])
        if self.example == "pipeline_train":
            return ex.pipeline(
                CFG,
                stage=rank,
                num_stages=WORLD,
                batch_size=BATCH_SIZE,
                microbatches=MICROBATCHES,
            )
        if "--wrap" in self.argv:
            return ex.fsdp1(CFG, WORLD)
        if self.example == "fsdp2_train":
            return ex.fsdp2(CFG, WORLD)
        return ex.fsdp_tp(CFG, self.layout, BATCH_SIZE)

    @property
    def world_dim(self) -> str | None:
        return "pp" if self.stage_named else None

    def waited_in(self) -> set[str]:
        """Labels of the groups in which the delayed rank's peers wait for it."""
        roles = {role for role, _ in self.expected(self.delay_rank)}
        if roles == {"world"}:
            return {group_label("0", self.world_dim)}
        # 2-D: the rank's tp peer and its dp_shard peer each wait about the delay.
        return roles


def _ddp(mode: str) -> tuple[str, ...]:
    return ("--mode", mode, "--width", str(DDP_WIDTH), "--batch-size", "16")


def _pp(schedule: str) -> tuple[str, ...]:
    return ("--schedule", schedule, "--microbatches", str(MICROBATCHES))


CASES = [
    Case("ddp", "ddp_train", _ddp("ddp"), 1, "backward", break_target=DDP_BREAK_TARGET),
    Case("fsdp2", "fsdp2_train", (), 2, "forward"),
    Case("fsdp1", "fsdp2_train", ("--wrap", "fsdp1"), 3, "backward"),
    # TP steps are the slowest here (DTensor dispatch on 2 cores) and noisiest: a longer delay.
    Case("tp", "fsdp_tp_train", ("--dp-shard", "1"), 1, "forward", ex.Layout(tp=4), 0.35),
    Case("fsdp_tp", "fsdp_tp_train", ("--dp-shard", "2"), 3, "backward", ex.Layout(2, 2), 0.35),
    Case("pp_gpipe", "pipeline_train", _pp("gpipe"), 2, "forward", stage_named=True),
    Case("pp_1f1b", "pipeline_train", _pp("1f1b"), 1, "backward", stage_named=True),
    Case("async", "ddp_train", _ddp("async"), 2, "backward"),
    Case("compiled", "ddp_train", _ddp("compiled"), 3, "forward"),
]
BY_NAME = {c.name: c for c in CASES}


@dataclass(frozen=True, slots=True)
class Launch:
    server: RunningServer
    out: Path
    prefix: str
    log: str
    returncode: int

    def results(self, case: Case) -> list[dict[str, Any]]:
        """Every rank's three run summaries of `case`."""
        paths = [self.out / case.name / f"rank{r}.json" for r in range(WORLD)]
        missing = [p.name for p in paths if not p.exists()]
        assert not missing, f"case {case.name} did not finish (rc {self.returncode}):\n{self.log}"
        return [json.loads(p.read_text()) for p in paths]

    def job_id(self, case: Case, suffix: str = "") -> str:
        return f"{self.prefix}-{case.name}{suffix}"


def plan(case: Case) -> dict[str, Any]:
    calls_per_step = sum(n for n, _ in case.expected(0).values())
    delay = [
        *("--delay-rank", str(case.delay_rank), "--delay-phase", case.delay_phase),
        *("--delay-s", str(case.delay_s), "--delay-from-step", str(DELAY_FROM_STEP)),
    ]
    if case.example != "ddp_train":  # its MLP's ~2 ms steps are far below DELAY_S anywhere
        delay += ["--delay-step-ratio", str(DELAY_STEP_RATIO)]
    return {
        "name": case.name,
        "example": case.example,
        "argv": [*case.argv, "--steps", str(STEPS)],
        "delay": delay,
        "broken_steps": BROKEN_STEPS,
        "break_target": case.break_target,
        # The tap breaks in the third step (or sooner, counting calls before the first).
        "break_after_calls": 2 * calls_per_step,
    }


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    """All cases in one torchrun launch against one collector."""
    torchrun = require_torchrun()
    tmp = tmp_path_factory.mktemp("parallel")
    names = os.environ.get("STEPSCOPE_TEST_PARALLEL_CASES")
    cases = [BY_NAME[n] for n in names.split(",")] if names else CASES
    with run_server() as server:
        doc = {
            "url": server.url,
            "prefix": "par",
            "out": str(tmp / "out"),
            "cases": [plan(c) for c in cases],
        }
        (tmp / "plan.json").write_text(json.dumps(doc))
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
        env["OMP_NUM_THREADS"] = "1"
        done = subprocess.run(
            [torchrun, "--standalone", f"--nproc_per_node={WORLD}", str(RANKS_SCRIPT)]
            + [str(tmp / "plan.json")],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        log = (done.stdout + done.stderr)[-6000:]
        yield Launch(server, tmp / "out", "par", log, done.returncode)


@pytest.fixture(params=[c.name for c in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    names = os.environ.get("STEPSCOPE_TEST_PARALLEL_CASES")
    if names and request.param not in names.split(","):
        pytest.skip("not in STEPSCOPE_TEST_PARALLEL_CASES")
    return BY_NAME[request.param]


def test_training_with_the_profiler_is_bit_identical_and_reports_every_step(
    launch: Launch, case: Case
) -> None:
    for rank, runs in enumerate(launch.results(case)):
        plain, profiled = runs["plain"], runs["profiled"]
        assert profiled["enabled"], f"rank {rank}: stepscope.init gave the no-op profiler"
        assert len(profiled["losses_hex"]) == STEPS
        assert profiled["losses_hex"] == plain["losses_hex"], rank
        assert profiled["params_hex"] == plain["params_hex"], rank
    steps = read_rows(launch.server.db_url, "steps", launch.job_id(case))
    assert sorted(Counter(r["rank"] for r in steps).items()) == [(r, STEPS) for r in range(WORLD)]


def test_stored_collectives_per_step_group_and_op_are_what_the_model_issues(
    launch: Launch, case: Case
) -> None:
    results = launch.results(case)
    rows = read_rows(launch.server.db_url, "collectives", launch.job_id(case))
    by_rank_step: dict[tuple[int, int], dict[tuple[str, str], tuple[int, int]]] = defaultdict(dict)
    for row in rows:
        by_rank_step[row["rank"], row["step"]][row["group"], row["op"]] = (
            row["count"],
            row["bytes"],
        )
    for rank in range(WORLD):
        groups = results[rank]["profiled"]["groups"]
        want = {(groups[role]["name"], op): v for (role, op), v in case.expected(rank).items()}
        # Step 0 also holds what ran before it (DDP's broadcast, FSDP's lazy init, the
        # pipeline's shape inference): every later step is a steady one.
        for step in range(1, STEPS):
            assert by_rank_step[rank, step] == want, (rank, step)
    first_seqs: dict[tuple[int, str, str], set[int]] = defaultdict(set)
    for row in rows:
        if row["step"] == 0:
            continue
        groups = results[row["rank"]]["profiled"]["groups"]
        role = next(r for r, g in groups.items() if g["name"] == row["group"])
        members = ex.mesh_members(role, row["rank"], WORLD, case.layout)
        assert groups[role]["ranks"] == members
        assert row["group_size"] == len(members)
        assert row["group_ranks"] == compact_ranks(members), row
        assert row["mesh_dim"] == (case.world_dim if role == "world" else role), row
        assert row["busy_s"] > 0, row
        # The waits lie inside the calls' spans (a completion stamped while the thread sat
        # in its wait counts until the thread resumed).
        assert 0 <= row["wait_s"] <= row["busy_s"] + 1e-6, row
        first_seqs[row["step"], row["group"], row["op"]].add(row["first_seq"])
    # The members of a group agree on which of its calls a step's first one was (DDP's step
    # timer numbers its synchronising backwards). Send/recv are pairwise: no group sequence.
    for (step, group, op), seqs in first_seqs.items():
        if op in ("send", "recv"):
            assert seqs == {None}, (step, group, op, seqs)
        else:
            assert len(seqs) == 1, (step, group, op, seqs)
            assert None not in seqs, (step, group, op)


def stored_findings(launch: Launch, job_id: str) -> list[Finding]:
    """stepscope.analysis.analyze of the job's stored frames."""
    engine = make_engine(launch.server.db_url)
    try:
        frames = {t: read_frame(engine, t, job_id) for t in ("steps", "collectives", "ranks")}
    finally:
        engine.dispose()
    [job] = read_rows(launch.server.db_url, "jobs", job_id)
    return analyze(
        frames["steps"],
        collectives=frames["collectives"],
        ranks=frames["ranks"],
        job=job,
        config=ANALYSIS,
    )


def compute_medians_s(launch: Launch, case: Case) -> dict[int, tuple[float, float]]:
    """rank -> median compute_s of its steady steps (after step 0) before the delay and from it."""
    by_rank: dict[int, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for row in read_rows(launch.server.db_url, "steps", launch.job_id(case)):
        if row["step"] > 0:
            by_rank[row["rank"]][row["step"] >= DELAY_FROM_STEP].append(row["compute_s"])
    return {
        rank: (statistics.median(before), statistics.median(after))
        for rank, (before, after) in sorted(by_rank.items())
    }


def straggler(launch: Launch, case: Case) -> Finding:
    """The delayed rank's straggler finding. 4 ranks on 2 busy cores can make another rank's
    ~2 ms compute slower for real (seen in CI: rank 3 named at a median 1.8 ms, beside the
    0.2 s delay of rank 1), which the test does not control. What it controls is the delay:
    its rank is named for it, and no other rank is blamed for a sizeable part of it (as a peer
    waiting for it would be)."""
    findings = stored_findings(launch, launch.job_id(case))
    stragglers = [f for f in findings if f.kind in STRAGGLER_KINDS]
    named = [f for f in stragglers if f.ranks == [case.delay_rank]]

    def why() -> object:  # read only when an assertion fails
        seen = [(f.kind, f.ranks, f.cause, f.evidence) for f in findings]
        return seen, compute_medians_s(launch, case)

    assert [(f.kind, f.cause) for f in named] == [("straggler_rank", "compute")], why()
    others_s = [excess_s(f) for f in stragglers if f not in named]
    assert all(s < excess_s(named[0]) / 4 for s in others_s), why()
    return named[0]


def excess_s(finding: Finding) -> float:
    """How much longer a straggler made its steps than expected."""
    assert finding.observed is not None, finding
    assert finding.expected is not None, finding
    return finding.observed - finding.expected


def test_a_rank_delayed_in_forward_or_backward_is_the_compute_straggler(
    launch: Launch, case: Case
) -> None:
    found = straggler(launch, case)
    assert found.first_step is not None
    assert found.evidence["comm_wait_s"]["rank"] < found.evidence["comm_wait_s"]["peers"]


def test_the_straggler_finding_names_the_group_or_stage_that_waited(
    launch: Launch, case: Case
) -> None:
    found = straggler(launch, case)
    if case.stage_named:
        stage = found.evidence["stage"]
        assert (stage["stage"] if isinstance(stage, dict) else stage) == case.delay_rank
    else:
        assert found.evidence["group"]["group"] in case.waited_in()


def test_an_error_inside_the_tap_turns_it_off_and_training_goes_on(
    launch: Launch, case: Case
) -> None:
    job_id = launch.job_id(case, "-broken")
    for rank, runs in enumerate(launch.results(case)):
        assert runs["broken"]["losses_hex"] == runs["plain"]["losses_hex"][:BROKEN_STEPS], rank
    events = read_rows(launch.server.db_url, "events", job_id)
    reported = {
        e["rank"] for e in events if e["kind"] == "exception" and "injected" in e["message"]
    }
    assert reported == set(range(WORLD)), events
    rows = read_rows(launch.server.db_url, "collectives", job_id)
    assert max((r["step"] for r in rows), default=-1) < 3, "the tap recorded after it failed"
    # Only the tap is off: every step is still reported.
    steps = read_rows(launch.server.db_url, "steps", job_id)
    assert len(steps) == WORLD * BROKEN_STEPS
