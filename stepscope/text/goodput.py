"""A job's goodput in words: its largest badput categories and who is behind them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stepscope.text.labels import goodput_category
from stepscope.text.numbers import share


def responsible_text(entries: Sequence[Mapping[str, Any]]) -> str:
    """The node or ranks the first entry of a category's `responsible` names: " (rank 3)"."""
    if not entries:
        return ""
    first = entries[0]
    if first.get("node"):
        return f" (node {first['node']})"
    ranks = list(first.get("ranks") or [])
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
