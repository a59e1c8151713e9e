"""What the read commands print for a finding in a mesh: its line, then where it is."""

from __future__ import annotations

import pytest

from stepscope.api.schemas import FindingRead
from stepscope.cli.output import print_finding_lines
from tests.findings import straggler

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
        "  Rank 5 (stage 1) is 32% slower in compute; its tp peers (ranks 4-5) waited for it, "
        "12 ms per step.",
    ]


def test_a_finding_outside_a_mesh_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    print_finding_lines([straggler()])

    assert capsys.readouterr().out.splitlines() == [
        "critical rank 5 (node-0001) straggler since step 20 compute +32% job cost 23.1%"
    ]
