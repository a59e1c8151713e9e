"""A job's goodput in words: its largest badput categories and who is behind them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stepscope.text.labels import goodput_category
from stepscope.text.numbers import share


def responsible_text(entries: Sequence[Mapping[str, Any]]) -> str:
    """Who a category's `responsible` names: " (node node-7)" for a node, else the ranks named
    alone, " (rank 1, 2)" (a rank's host is where it ran, not the cause)."""
    if not entries:
        return ""
    first = entries[0]
    ranks = list(first.get("ranks") or [])
    if first.get("node") and len(ranks) != 1:
        return f" (node {first['node']})"
    if len(ranks) == 1:
        alone = (e.get("ranks") or [] for e in entries)
        ranks = list(dict.fromkeys(r[0] for r in alone if len(r) == 1))
    return f" (rank {', '.join(map(str, ranks[:4]))})" if ranks else ""


def top_badput(
    categories_s: Mapping[str, float],
    total_s: float,
    responsible: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    num: int = 3,
) -> list[str]:
    """The `num` largest badput categories: "restart 15.1% (rank 3)"."""
    if total_s <= 0:
        return []
    largest = sorted(
        ((c, v) for c, v in categories_s.items() if c != "productive" and v > 0),
        key=lambda item: -item[1],
    )[:num]
    return [
        f"{goodput_category(c)} {share(v / total_s)}{responsible_text(responsible.get(c, []))}"
        for c, v in largest
    ]
