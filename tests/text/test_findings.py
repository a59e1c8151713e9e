"""Findings in words: the one-line form and the sentences, from one module."""

from __future__ import annotations

from stepscope.text.findings import evidence_lines, finding_line, finding_text, job_cost, subject
from tests.findings import straggler


def test_findings_in_plain_words() -> None:
    text = finding_text(straggler())
    assert text.title == "Straggler rank"
    assert subject(text) == "rank 5 on node-0001"
    assert text.when == "since step 20 (ongoing)"
    assert text.cause == "slower compute on its GPU"
    assert text.effect == "step time +30.0% (650 ms against 500 ms expected)"
    assert text.cost == "costs the job 23.1% of its step time"
    assert text.evidence[0] == (
        "Its median compute is 620 ms per step against 470 ms on the other ranks."
    )


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
