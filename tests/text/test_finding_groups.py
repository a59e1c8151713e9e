"""Findings in reading order: the most pressing first, a job-level change folded under the
rank-level finding the analysis named as its cause."""

from __future__ import annotations

from typing import Any

from stepscope.schema import Finding
from stepscope.text.finding_groups import folded_lines, grouped
from tests.findings import straggler


def drop(metric: str, caused_by: list[dict[str, Any]], **kw: Any) -> Finding:
    fields: dict[str, Any] = {
        "id": 2,
        "kind": "throughput_drop",
        "ranks": [5],
        "node": None,
        "first_step": 20,
        "last_step": 399,
        "metric": metric,
        "effect": -0.21,
        "evidence": {"caused_by": caused_by, "scope": "ranks" if caused_by else "job-wide"},
    }
    return straggler(**{**fields, **kw})


CAUSE = {"kind": "straggler_rank", "ranks": [5], "node": "node-0001", "first_step": 20}


def test_the_drops_a_straggler_explains_fold_under_it_on_one_line() -> None:
    slow = straggler()
    tokens, mfu = drop("tokens_per_s", [CAUSE]), drop("mfu", [CAUSE], effect=-0.2)

    (group,) = grouped([mfu, tokens, slow], lambda f: f)

    assert group.root is slow
    assert group.folded == [tokens, mfu]
    assert folded_lines(group.folded) == [
        "  └ job throughput drop steps 20-399: tokens/s -21.0%, MFU -20.0%"
    ]


def test_a_change_whose_cause_is_not_listed_or_that_is_job_wide_stands_alone() -> None:
    elsewhere = {**CAUSE, "first_step": 300}  # another episode of the same rank
    job_wide = drop("tokens_per_s", [], effect=-0.5, severity="critical")
    unexplained = drop("mfu", [elsewhere], severity="warning", effect=-0.04)
    slow = straggler()  # costs 23%: after the job-wide drop of 50%

    groups = grouped([unexplained, slow, job_wide], lambda f: f)

    assert [g.root for g in groups] == [job_wide, slow, unexplained]
    assert all(g.folded == [] for g in groups)


def test_an_open_hang_comes_first_and_lower_severities_last() -> None:
    info = straggler(severity="info", effect=0.9)
    hang = straggler(kind="hang", evidence={"class": "never_entered"})
    slow = straggler()

    assert [g.root for g in grouped([info, slow, hang], lambda f: f)] == [hang, slow, info]


def test_changes_over_different_steps_say_each_its_steps() -> None:
    tokens = drop("tokens_per_s", [CAUSE])
    mfu = drop("mfu", [CAUSE], first_step=22)

    assert folded_lines([tokens, mfu]) == [
        "  └ job throughput drop: tokens/s -21.0% from step 20, MFU -21.0% from step 22"
    ]
