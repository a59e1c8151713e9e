"""Hangs named end to end (#19): real torchrun ranks on gloo stall on cue, a real server stores
the `hang` finding, and each test checks whom it names and how long after the stall it was
stored (printed, and bounded generously: a loaded machine must not fail it).

Three launches serve every case: tests/profiler/hang_job.py's `main` scenario (4 ranks: a slow
first step, a checkpoint phase, a data-loader sleep, SIGSTOP/SIGCONT, a mismatched
collective), its `pipeline` scenario (3 GPipe stages, one stalls) run under `stepscope run
--on-hang dump-and-exit`, and its `stop` scenario (2 ranks, one stopped past its threshold)
run under `stepscope run`, which signals silent ranks for their stacks.

One stall of one rank is one hang finding, whatever the rank does as it comes back.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from stepscope.profiler.hangs.dump_watcher import is_stopped
from tests.live_server import RunningServer, read_rows, run_server
from tests.profiler import hang_job
from tests.support import require_torchrun

pytestmark = pytest.mark.torchrun

REPO = Path(__file__).resolve().parents[2]
HANG_AFTER_S = 2.0
HEARTBEAT_S = 0.5
SILENT_AFTER_S = 4.0
STALL_TO_FINDING_BOUND_S = 20.0
"""The bound on stall → stored finding the tests assert: the threshold plus a report, an
attribution and generous room for a loaded machine (the measured times are printed)."""
LAUNCH_TIMEOUT_S = 240.0
STOPPED_S = 8.0
"""How long the `stop` scenario keeps its rank stopped, at least: past its threshold and the 2 s
after it at which a rank's in-process timer used to dump its stacks."""


@dataclass(slots=True)
class Run:
    """What one launch left: the job's hang findings, each rank's marks, and the driver's."""

    job_id: str
    findings: list[dict[str, Any]] = field(default_factory=list)
    marks: dict[int, dict[str, float]] = field(default_factory=dict)
    seen_at: dict[str, float] = field(default_factory=dict)
    """When the driver first saw a stored finding of each class (epoch s)."""
    open_findings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """A class's finding as stored while it was open, every rank listed by state (updates
    as the hang ends may list fewer: a culprit that woke no longer reports a hang)."""
    returncode: int | None = None
    ended_at: float = 0.0
    """When the launch ended (epoch s)."""
    output: str = ""
    out_dir: Path = Path()


def hang_findings(server: RunningServer, job_id: str) -> list[dict[str, Any]]:
    rows = [r for r in read_rows(server.db_url, "findings", job_id) if r["kind"] == "hang"]
    for row in rows:
        for key in ("evidence", "ranks"):
            if isinstance(row[key], str):
                row[key] = json.loads(row[key])
    return sorted(rows, key=lambda r: r["id"])


def read_marks(out: Path, num_ranks: int) -> dict[int, dict[str, float]]:
    marks = {}
    for rank in range(num_ranks):
        path = out / f"rank{rank}.json"
        try:
            marks[rank] = json.loads(path.read_text())
        except (OSError, ValueError):
            marks[rank] = {}
    return marks


def start(
    server: RunningServer,
    scenario: str,
    nproc: int,
    out: Path,
    job_id: str,
    *,
    stepscope_run: list[str] | None = None,
    job_args: tuple[str, ...] = (),
) -> subprocess.Popen[str]:
    """Launch the scenario with torchrun, under `stepscope run [stepscope_run] --` unless None."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    env.update(
        OMP_NUM_THREADS="1",
        STEPSCOPE_URL=server.url,
        STEPSCOPE_JOB_ID=job_id,
        STEPSCOPE_HANG_DUMP_DIR=str(out / "dumps"),
    )
    torchrun = [require_torchrun(), "--standalone", f"--nproc_per_node={nproc}"]
    script = [str(Path(hang_job.__file__)), "--scenario", scenario, "--out", str(out)]
    script += ["--hang-after-s", str(HANG_AFTER_S), "--heartbeat-s", str(HEARTBEAT_S), *job_args]
    cmd = [*torchrun, *script]
    if stepscope_run is not None:
        cmd = [sys.executable, "-m", "stepscope.cli", "run", *stepscope_run, "--", *cmd]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(what: str, check: Callable[[], bool], proc: subprocess.Popen[str]) -> float:
    """Poll until `check` holds; when it did (epoch s). Fails when the job ends first."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline:
        if check():
            return time.time()
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"the job ended (exit {proc.returncode}) before {what}:\n{out[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def end(proc: subprocess.Popen[str], run: Run) -> None:
    """End the job: SIGTERM to torchrun (it ends its ranks), then SIGKILL to what is left
    (torchrun starts each rank in a session of its own)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    for marks in read_marks(run.out_dir, len(run.marks) or 4).values():
        if "pid" in marks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(marks["pid"]), signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    run.returncode, run.output = proc.returncode, out


@pytest.fixture(scope="module")
def hang_server() -> Iterator[RunningServer]:
    with run_server(env={"STEPSCOPE_HANG_SILENT_AFTER_S": str(SILENT_AFTER_S)}) as server:
        yield server


@pytest.fixture(scope="module")
def main_run(hang_server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The 4-rank job, driven: SIGCONT once the frozen rank is named, the end once the
    mismatched collective is named."""
    out = tmp_path_factory.mktemp("hang-main")
    run = Run(job_id="hang-main", out_dir=out)
    proc = start(hang_server, "main", 4, out, run.job_id)

    def has(hang_class: str, num_ranks_seen: int = 0) -> bool:
        """A stored finding of the class whose ranks by state count `num_ranks_seen` ranks
        (kept in run.open_findings)."""
        for f in hang_findings(hang_server, run.job_id):
            if f["evidence"]["class"] == hang_class and ranks_seen(f) >= num_ranks_seen:
                run.open_findings[hang_class] = f
                return True
        return False

    try:
        wait_for("a never_entered hang", lambda: has("never_entered", num_ranks_seen=4), proc)
        freeze = hang_job.FREEZE_RANK
        wait_for("rank 3 froze", lambda: "freeze" in read_marks(out, 4)[freeze], proc)
        run.seen_at["silent"] = wait_for("a silent hang", lambda: has("silent"), proc)
        os.kill(int(read_marks(out, 4)[freeze]["pid"]), signal.SIGCONT)
        # Named once every rank entered; listed by state once every rank reported a hang.
        run.seen_at["mismatched"] = wait_for(
            "a mismatched hang", lambda: has("mismatched", num_ranks_seen=4), proc
        )
        run.findings = hang_findings(hang_server, run.job_id)
    finally:
        run.marks = read_marks(out, 4)
        end(proc, run)
    say(f"hangs stored: {summary(run)}")
    return run


def ranks_seen(finding: dict[str, Any]) -> int:
    by_state = finding["evidence"]["ranks_by_state"]
    waiting = sum(w["num_ranks"] for w in by_state["waiting"].values())
    return int(waiting + by_state["num_elsewhere"] + by_state["num_silent"])


def of_class(run: Run, hang_class: str) -> dict[str, Any]:
    found = [f for f in run.findings if f["evidence"]["class"] == hang_class]
    assert len(found) == 1, f"{len(found)} {hang_class} hangs among {summary(run)}"
    return found[0]


def summary(run: Run) -> list[tuple[Any, ...]]:
    """Each stored hang as (class, ranks, first step, since, closed), times from the
    first mark: what a failure shows."""
    t0 = min((t for m in run.marks.values() for k, t in m.items() if k != "pid"), default=0.0)
    marks = {
        r: {k: round(t - t0, 2) for k, t in m.items() if k != "pid"} for r, m in run.marks.items()
    }
    out: list[tuple[Any, ...]] = [("marks", marks)]
    for f in run.findings:
        e = f["evidence"]
        closed = e.get("closed_at")
        out.append(
            (
                e["class"],
                f["ranks"],
                f["first_step"],
                round(e["since_ts"] - t0, 2),
                None if closed is None else round(closed - t0, 2),
            )
        )
    return out


def say(line: str) -> None:
    """Print a measured time (seen with pytest -s; the report quotes them)."""
    sys.stdout.write(f"\n{line}\n")


def stall_to_finding_s(finding: dict[str, Any], stall_ts: float, what: str) -> float:
    elapsed_s = finding["detected_at"] - stall_ts
    say(f"{what}: stall -> stored finding {elapsed_s:.2f} s (hang_after_s {HANG_AFTER_S})")
    return float(elapsed_s)


def test_a_data_loader_sleep_names_the_rank_its_peers_wait_for_and_its_stack(
    main_run: Run,
) -> None:
    finding = main_run.open_findings["never_entered"]
    evidence = finding["evidence"]
    assert finding["ranks"] == [hang_job.DATA_STALL_RANK]
    assert finding["first_step"] == hang_job.DATA_STALL_AT
    # The peers wait in the step's all_reduce on the world group (one per step before it).
    assert (evidence["group_name"], evidence["op"]) == ("0", "all_reduce")
    assert evidence["seq"] == hang_job.DATA_STALL_AT + 1
    functions = [frame["function"] for frame in evidence["culprit_stack"]]
    assert functions[-1] == "sleeps_in_the_data_loader"
    assert "batches" in functions
    majority = [frame["function"] for frame in evidence["majority_stack"]]
    assert majority[-1] == "all_reduce"  # the profiler's own frames left out
    assert "main_scenario" in majority
    waiting = evidence["ranks_by_state"]["waiting"]
    assert [(w["op"], w["ranks"]) for w in waiting.values()] == [("all_reduce", "0-1,3")]
    assert evidence["ranks_by_state"]["elsewhere"] == [hang_job.DATA_STALL_RANK]
    stall_ts = main_run.marks[hang_job.DATA_STALL_RANK]["data_stall"]
    elapsed_s = stall_to_finding_s(finding, stall_ts, "data-loader sleep")
    assert HANG_AFTER_S <= elapsed_s <= STALL_TO_FINDING_BOUND_S
    # It ended when the rank woke: closed, with the time lost.
    closed = of_class(main_run, "never_entered")["evidence"]
    assert closed["time_lost_s"] == pytest.approx(hang_job.DATA_STALL_S, abs=2.0)


def test_a_mismatched_collective_names_the_odd_rank_and_both_ops(main_run: Run) -> None:
    finding = of_class(main_run, "mismatched")
    evidence = finding["evidence"]
    assert finding["ranks"] == [hang_job.MISMATCH_RANK]
    assert evidence["op"] == "all_reduce,all_gather"  # the majority's first
    assert evidence["group_name"] == "0"
    waiting = {w["op"]: w["ranks"] for w in evidence["ranks_by_state"]["waiting"].values()}
    assert waiting == {"all_reduce": "0,2-3", "all_gather": "1"}
    # It is named once the first rank to block in it has waited hang_after_s.
    stall_ts = min(m["mismatch"] for m in main_run.marks.values())
    elapsed_s = stall_to_finding_s(finding, stall_ts, "mismatched collective")
    assert HANG_AFTER_S <= elapsed_s <= STALL_TO_FINDING_BOUND_S


def test_a_frozen_rank_is_named_silent(main_run: Run) -> None:
    finding = of_class(main_run, "silent")
    assert finding["ranks"] == [hang_job.FREEZE_RANK]
    assert finding["evidence"]["ranks_by_state"]["silent"] == [hang_job.FREEZE_RANK]
    stall_ts = main_run.marks[hang_job.FREEZE_RANK]["freeze"]
    silent_s = main_run.seen_at["silent"] - stall_ts
    say(f"SIGSTOP: stall -> named silent {silent_s:.2f} s (silent_after_s {SILENT_AFTER_S})")
    # The hang may first be stored as never_entered (the frozen rank's last heartbeat came
    # after its peers blocked) and turns silent once the rank stayed quiet silent_after_s.
    elapsed_s = stall_to_finding_s(finding, stall_ts, "SIGSTOP")
    assert 0 < elapsed_s <= STALL_TO_FINDING_BOUND_S
    # Silence counts from the rank's last report, up to a heartbeat (and a poll) before it
    # froze.
    earliest_s = SILENT_AFTER_S - HEARTBEAT_S - 0.2
    assert earliest_s <= main_run.seen_at["silent"] - stall_ts <= STALL_TO_FINDING_BOUND_S


def test_sigcont_closes_the_hang_with_the_time_lost(main_run: Run) -> None:
    evidence = of_class(main_run, "silent")["evidence"]
    marks = main_run.marks[hang_job.FREEZE_RANK]
    frozen_s = marks["thawed"] - marks["freeze"]
    assert evidence["closed_at"] is not None
    assert evidence["time_lost_s"] == pytest.approx(frozen_s, abs=2.0)
    assert evidence["closed_at"] - marks["thawed"] <= STALL_TO_FINDING_BOUND_S
    say(f"SIGCONT: closed {evidence['closed_at'] - marks['thawed']:.2f} s after the thaw")


def test_no_hang_on_a_slow_first_step_a_checkpoint_phase_or_clean_steps(main_run: Run) -> None:
    # Only the three injected hangs: none from the slow first step, the 60 s checkpoint
    # phase (the other ranks waited for rank 0 in an all_reduce meanwhile) or clean steps.
    # Every finding starts inside an injected hang, and each injected class is there.
    classes = {f["evidence"]["class"] for f in main_run.findings}
    assert {"mismatched", "never_entered", "silent"} <= classes
    marks = main_run.marks
    data_stall = marks[hang_job.DATA_STALL_RANK]["data_stall"]
    injected = [
        (data_stall, data_stall + hang_job.DATA_STALL_S),
        (marks[hang_job.FREEZE_RANK]["freeze"], marks[hang_job.FREEZE_RANK]["thawed"]),
        (min(m["mismatch"] for m in marks.values()), math.inf),
    ]
    for finding in main_run.findings:
        since_ts = finding["evidence"]["since_ts"]
        assert any(start - 0.5 <= since_ts <= end for start, end in injected), summary(main_run)
    first_injected = data_stall
    assert min(f["evidence"]["since_ts"] for f in main_run.findings) >= first_injected - 0.5
    assert main_run.marks[0]["checkpoint"] < first_injected
    assert main_run.marks[0]["slow_first_step"] < first_injected


def naming(run: Run, rank: int) -> list[dict[str, Any]]:
    """The stored hang findings that name `rank`."""
    return [f for f in run.findings if rank in f["ranks"]]


def test_a_rank_stopped_and_resumed_is_one_hang(main_run: Run) -> None:
    # Named silent while stopped; what it reports as it thaws (the stall it lived through,
    # possibly after its peers' heartbeats closed the hang) adds no second finding.
    [finding] = naming(main_run, hang_job.FREEZE_RANK)
    assert finding["evidence"]["class"] == "silent"
    assert finding["first_step"] == hang_job.FREEZE_AT
    assert finding["evidence"]["closed_at"] is not None


def test_a_rank_entering_late_is_one_hang(main_run: Run) -> None:
    [finding] = naming(main_run, hang_job.DATA_STALL_RANK)
    assert finding["evidence"]["class"] == "never_entered"
    assert finding["first_step"] == hang_job.DATA_STALL_AT
    assert finding["evidence"]["closed_at"] is not None


# ---- a pipeline stage stalls; `stepscope run --on-hang dump-and-exit` ends the job -----------


@pytest.fixture(scope="module")
def pipeline_run(hang_server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("hang-pipeline")
    run = Run(job_id="hang-pipeline", out_dir=out)
    proc = start(
        hang_server, "pipeline", 3, out, run.job_id, stepscope_run=["--on-hang", "dump-and-exit"]
    )
    try:
        out_text, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        run.returncode, run.output, run.ended_at = proc.returncode, out_text, time.time()
    finally:
        if proc.poll() is None:
            end(proc, run)
        run.marks = read_marks(out, 3)
        run.findings = hang_findings(hang_server, run.job_id)
    return run


def test_a_stalled_pipeline_stage_is_named(pipeline_run: Run) -> None:
    [finding] = pipeline_run.findings
    evidence = finding["evidence"]
    stage = hang_job.PIPELINE_STALL_STAGE
    assert finding["ranks"] == [stage]
    assert evidence["class"] == "never_entered"
    # Its neighbours wait in send/recv on their channel with it, in the pp group.
    assert evidence["mesh_dim"] == "pp"
    assert evidence["group"] == "pp"
    assert evidence["op"] in ("send", "recv")
    assert stage in [int(r) for r in evidence["group_name"].split(":")[1].split(">")]
    assert evidence["culprit_stack"][-1]["function"] == "stage_stalls_in_its_forward"
    waiting = evidence["ranks_by_state"]["waiting"]
    assert sorted(r for w in waiting.values() for r in w["ranks"].split(",")) == ["0", "2"]
    elapsed_s = stall_to_finding_s(finding, pipeline_run.marks[stage]["stage_stall"], "pipeline")
    assert HANG_AFTER_S <= elapsed_s <= STALL_TO_FINDING_BOUND_S


def test_on_hang_dump_and_exit_dumps_the_flight_recorders_and_ends_the_job(
    pipeline_run: Run,
) -> None:
    assert pipeline_run.returncode not in (0, None), pipeline_run.output[-3000:]
    assert "hang confirmed (never_entered, ranks [1]" in pipeline_run.output
    dumps = sorted((pipeline_run.out_dir / "dumps").glob("*.fr.pickle"))
    assert [p.name.split("-rank")[1].split("-")[0] for p in dumps] == ["0", "1", "2"]
    for path in dumps:
        trace = pickle.loads(path.read_bytes())
        # The per-step all_reduces before the stall (stack traces left out).
        all_reduces = [e for e in trace["entries"] if e["profiling_name"] == "gloo:all_reduce"]
        assert len(all_reduces) == hang_job.PIPELINE_STALL_AT, path
        assert {e["process_group"][0] for e in all_reduces} == {"0"}
        assert all(not e.get("frames") for e in all_reduces)
    # No rank finished: the job was ended, soon after the hang was stored.
    assert all("done" not in m for m in pipeline_run.marks.values())
    ended_s = pipeline_run.ended_at - pipeline_run.findings[0]["detected_at"]
    say(f"on-hang: {len(dumps)} flight recorder dumps; job ended {ended_s:.1f} s after the finding")
    assert 0 < ended_s <= 60


def test_a_rank_that_never_enters_is_one_hang(pipeline_run: Run) -> None:
    [finding] = naming(pipeline_run, hang_job.PIPELINE_STALL_STAGE)
    assert finding["evidence"]["class"] == "never_entered"
    assert finding["first_step"] == hang_job.PIPELINE_STALL_AT
    assert len(pipeline_run.findings) == 1


# ---- a rank stopped past its threshold under `stepscope run` (a dump directory) resumes -------


@pytest.fixture(scope="module")
def stop_run(hang_server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """2 ranks under `stepscope run`: rank 1 stopped for STOPPED_S (and until the server named
    it), then resumed; the job runs to its end."""
    out = tmp_path_factory.mktemp("hang-stop")
    run = Run(job_id="hang-stop", out_dir=out)
    steps = ("--steps", str(hang_job.STOP_NUM_STEPS))
    proc = start(hang_server, "stop", 2, out, run.job_id, stepscope_run=[], job_args=steps)
    rank = hang_job.STOP_RANK

    def stopped() -> bool:
        marks = read_marks(out, 2)[rank]
        return "freeze" in marks and is_stopped(int(marks["pid"]))

    try:
        wait_for("rank 1 stopped", stopped, proc)
        time.sleep(STOPPED_S)
        wait_for(
            "the stopped rank named", lambda: bool(hang_findings(hang_server, run.job_id)), proc
        )
        os.kill(int(read_marks(out, 2)[rank]["pid"]), signal.SIGCONT)
        out_text, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        run.returncode, run.output, run.ended_at = proc.returncode, out_text, time.time()
    finally:
        if proc.poll() is None:
            end(proc, run)
        run.marks = read_marks(out, 2)
        run.findings = hang_findings(hang_server, run.job_id)
    return run


def test_a_rank_stopped_past_its_threshold_under_a_dump_directory_finishes_the_job(
    stop_run: Run, hang_server: RunningServer
) -> None:
    assert stop_run.returncode == 0, stop_run.output[-3000:]
    assert all("done" in m for m in stop_run.marks.values()), stop_run.marks
    marks = stop_run.marks[hang_job.STOP_RANK]
    assert marks["thawed"] - marks["freeze"] >= STOPPED_S
    # Every step of every rank recorded.
    rows = read_rows(hang_server.db_url, "steps", stop_run.job_id)
    steps = Counter((r["rank"], r["step"]) for r in rows)
    assert steps == {(r, s): 1 for r in range(2) for s in range(hang_job.STOP_NUM_STEPS)}
    # Not signalled while stopped, and no timer of its own went off when it resumed: no stacks
    # dumped (a rank's dump file is removed at its close when it holds none).
    assert list((stop_run.out_dir / "dumps").glob("*.txt")) == []


def test_a_rank_stopped_past_its_threshold_is_one_hang_closed_with_the_time_lost(
    stop_run: Run,
) -> None:
    [finding] = stop_run.findings
    assert finding["ranks"] == [hang_job.STOP_RANK]
    assert finding["evidence"]["class"] == "silent"
    assert finding["first_step"] == hang_job.STOP_AT
    marks = stop_run.marks[hang_job.STOP_RANK]
    assert finding["evidence"]["time_lost_s"] == pytest.approx(
        marks["thawed"] - marks["freeze"], abs=2.0
    )
