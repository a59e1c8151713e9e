"""Who a badput category is on, in words."""

from __future__ import annotations

from stepscope.text.goodput import responsible_text, top_badput


def test_straggler_wait_names_the_straggling_ranks_not_the_host_they_share() -> None:
    two_ranks = [
        {"ranks": [1], "node": "vm", "cause": "data"},
        {"ranks": [2], "node": "vm", "cause": "compute"},
    ]
    assert responsible_text(two_ranks) == " (rank 1, 2)"
    a_node = [{"ranks": [8, 9, 10, 11], "node": "node-0001", "cause": "compute"}]
    assert responsible_text(a_node) == " (node node-0001)"
    assert responsible_text([{"ranks": [3], "message": "RuntimeError"}]) == " (rank 3)"
    assert responsible_text([]) == ""


def test_the_largest_badput_first_with_who_is_behind_it() -> None:
    categories = {"productive": 50.0, "straggler_wait": 30.0, "data": 20.0}
    responsible = {"straggler_wait": [{"ranks": [2], "node": "vm"}]}
    assert top_badput(categories, 100.0, responsible) == [
        "straggler wait 30.0% (rank 2)",
        "data 20.0%",
    ]
