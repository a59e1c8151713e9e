"""What the read commands print for a finding in a mesh: its line, then where it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepscope import query
from stepscope.api.schemas import FindingRead
from stepscope.cli.output import print_finding_lines
from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from tests.findings import straggler
from tests.mesh_jobs import JOB_ID, LATE_RANK, mesh_job, write_in_rounds

GROUP = {"group": "tp", "group_name": "7", "group_ranks": "4-5", "mesh_dim": "tp",
         "peers_lateness_s": 0.012, "rank_lateness_s": 0.0}  # fmt: skip


def test_findings_say_the_stage_and_the_group_the_peers_waited_in(
    capsys: pytest.CaptureFixture[str],
) -> None:
    f = straggler(evidence={**straggler().evidence, "stage": 1, "group": GROUP})
    served = FindingRead.of(f)

    print_finding_lines([f])
    stored = capsys.readouterr().out
    print_finding_lines([served])
    read = capsys.readouterr().out

    assert stored == read
    assert stored.splitlines() == [
        "critical rank 5 (stage 1) straggler since step 20 compute +32% job cost 23.1%",
        "  Rank 5 (stage 1) is 32% slower in compute; its tp peers (ranks 4-5) waited for",
        "  it, 12 ms per step.",
    ]


def test_a_finding_outside_a_mesh_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    print_finding_lines([straggler()])

    assert capsys.readouterr().out.splitlines() == [
        "critical rank 5 (node-0001) straggler since step 20 compute +32% job cost 23.1%"
    ]


def test_a_late_rank_s_line_and_sentence_from_the_analysis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'stepscope.db'}")
    upgrade(engine)
    for _ in write_in_rounds(engine, mesh_job(), steps=100):
        pass
    JobAnalyzer(engine, JOB_ID, grace_s=0.0).run()
    (late,) = [f for f in query.findings(engine, JOB_ID) if f.kind == "straggler_rank"]
    engine.dispose()

    print_finding_lines([late])
    line, *wrapped = capsys.readouterr().out.splitlines()
    assert line.split()[1:3] == ["rank", str(LATE_RANK)]
    assert all(len(part) <= 80 and part.startswith("  ") for part in wrapped)
    where = " ".join(part.strip() for part in wrapped)
    assert where.startswith(f"Rank {LATE_RANK} is ")
    assert where.endswith("its dp_shard peers (ranks 1-3:2) waited for it, 51.2 ms per step.")
