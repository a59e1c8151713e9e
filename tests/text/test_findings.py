"""Findings in words: the one-line form and the sentences, from one module."""

from __future__ import annotations

from stepscope.text.findings import (
    cause_text,
    evidence_lines,
    finding_line,
    finding_text,
    job_cost,
    mesh_sentence,
    subject,
)
from tests.findings import straggler


def test_findings_in_plain_words() -> None:
    text = finding_text(straggler())
    assert text.title == "Straggler rank"
    assert subject(text) == "rank 5 on node-0001"
    assert text.when == "since step 20 (ongoing)"
    assert text.cause == "slower compute"
    assert text.effect == "step time +30.0% (650 ms against 500 ms expected)"
    assert text.cost == "costs the job 23.1% of its step time"
    assert text.evidence[0] == (
        "Its median compute is 620 ms per step against 470 ms on the other ranks."
    )


def test_compute_is_said_to_run_on_a_gpu_only_where_the_ranks_gpu_was_measured() -> None:
    measured = {"samples": 30, "sm_clock_mhz": {"rank": 1980.0, "peers": 1980.0}}
    on_gpu = straggler(evidence={**straggler().evidence, "gpu": measured})
    on_cpu = straggler()  # a CPU job: no GPU telemetry, no "gpu" evidence
    assert finding_text(on_gpu).cause == "slower compute on its GPU"
    assert finding_text(on_cpu).cause == "slower compute"
    assert cause_text(straggler(evidence={**straggler().evidence, "gpu": {}})) == "slower compute"
    data = straggler(cause="data", evidence={**straggler().evidence, "gpu": measured})
    assert cause_text(data) == "waiting for data (the input pipeline)"


def test_evidence_says_what_a_straggler_costs_and_what_caused_a_change() -> None:
    impact = {"step_share": 0.02, "step_s": 0.01, "gpus": 20.5, "method": "slowest_arrival"}
    slow = straggler(evidence={"impact": impact})
    assert "shorter with it at the median: the work of 20.5 GPUs." in " ".join(evidence_lines(slow))
    caused = straggler(
        kind="throughput_drop",
        metric="tokens_per_s",
        evidence={
            "scope": "ranks",
            "caused_by": [
                {"kind": "straggler_rank", "ranks": [5], "node": None, "first_step": 150}
            ],
        },
    )
    assert evidence_lines(caused)[-1] == ("It starts with a Straggler rank (5, from step 150).")
    wide = straggler(kind="throughput_drop", evidence={"scope": "job-wide", "caused_by": []})
    assert "the whole job changed" in evidence_lines(wide)[-1]


def test_the_line_and_the_sentences_say_the_same_cost() -> None:
    f = straggler()
    line = finding_line(f)
    assert line == "critical rank 5 (node-0001) straggler since step 20 compute +32% job cost 23.1%"
    assert f"{job_cost(f):.1%}" in line
    assert finding_text(f).cost == f"costs the job {job_cost(f):.1%} of its step time"


TP_GROUP = {
    "group": "tp",
    "group_name": "7",
    "group_ranks": "4-5",
    "mesh_dim": "tp",
    "peers_lateness_s": 0.012,
    "rank_lateness_s": 0.0001,
}


def in_mesh(**evidence: object) -> dict[str, object]:
    base = dict(straggler().evidence)
    return {**base, "stage": 1, "group": TP_GROUP, **evidence}


def test_a_straggler_says_its_stage_and_the_group_its_peers_waited_in() -> None:
    f = straggler(evidence=in_mesh(), node=None, effect=None)
    assert finding_line(f) == (
        "critical rank 5 (stage 1) straggler since step 20 compute +32%, tp peers waited"
    )
    assert mesh_sentence(f) == (
        "Rank 5 (stage 1) is 32% slower in compute; its tp peers (ranks 4-5) waited for it, "
        "12 ms per step."
    )
    assert evidence_lines(f)[0] == mesh_sentence(f)
    assert subject(finding_text(f)) == "rank 5 (stage 1)"


def test_the_line_keeps_the_cost_and_the_stage_over_the_group_and_the_node() -> None:
    f = straggler(evidence=in_mesh())

    assert finding_line(f) == (
        "critical rank 5 (stage 1) straggler since step 20 compute +32% job cost 23.1%"
    )
    assert finding_line(f, width=140) == (
        "critical  rank 5 (stage 1, node-0001)  straggler since step 20  compute +32%, tp peers "
        "waited  costs the job 23.1% of its step time"
    )
    assert subject(finding_text(f)) == "rank 5 (stage 1) on node-0001"


def test_a_group_not_known_is_not_said() -> None:
    unknown = straggler(evidence=in_mesh(group={**TP_GROUP, "group": "all"}, stage=None))
    assert "peers waited" not in finding_line(unknown)
    assert mesh_sentence(unknown) is None
    assert finding_line(unknown).split()[:4] == ["critical", "rank", "5", "(node-0001)"]


def test_a_slow_collective_names_its_group() -> None:
    evidence = {"op": "all_reduce", "group": "dp", "message_bytes_at_least": 2**20, "steps": 40}
    f = straggler(kind="slow_collective", ranks=[], node=None, effect=-0.4, evidence=evidence)
    named = straggler(
        kind="slow_collective", ranks=[], node=None, effect=-0.4,
        evidence={**evidence, "group": "group 3"},
    )  # fmt: skip

    assert finding_line(f) == "critical  job  slow all_reduce in dp since step 20  busbw -40%"
    assert mesh_sentence(f) == "The slow all_reduce is in the dp groups."
    assert mesh_sentence(named) == "The slow all_reduce is in group 3."
    assert "all_reduce calls in dp of at least 1 MiB over 40 steps." in evidence_lines(f)


def test_a_data_stall_against_peers_that_wait_for_nothing_is_said_in_seconds_per_step() -> None:
    stalled = straggler(
        cause="data",
        evidence={"component": "data_s", "rank_median_s": 0.1003, "peers_median_s": 0.00004},
    )
    assert "data +100 ms/step" in finding_line(stalled)
    in_group = straggler(
        cause="data",
        node=None,
        evidence=in_mesh(component="data_s", rank_median_s=0.1003, peers_median_s=0.00004),
    )
    assert mesh_sentence(in_group) == (
        "Rank 5 (stage 1) spends 100 ms more per step in data loading; its tp peers "
        "(ranks 4-5) waited for it, 12 ms per step."
    )
    slower = straggler(
        cause="data",
        evidence={"component": "data_s", "rank_median_s": 0.3, "peers_median_s": 0.1},
    )
    assert "data +200%" in finding_line(slower)
