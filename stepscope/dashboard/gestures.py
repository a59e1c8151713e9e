"""What a user's zoom or click on a figure asks for, from plotly's event data."""

from __future__ import annotations

import re
from typing import Any

_RANK_LABEL = re.compile(r"^(\d+)")


def step_range(relayout: dict[str, Any] | None) -> tuple[int, int] | tuple[None, None] | None:
    """The step range a heatmap relayout asks for: (lo, hi), (None, None) for a reset,
    None when it did not touch the step axis."""
    if not relayout:
        return None
    if relayout.get("xaxis.autorange"):
        return None, None
    lo, hi = relayout.get("xaxis.range[0]"), relayout.get("xaxis.range[1]")
    if lo is None and isinstance(relayout.get("xaxis.range"), list):
        lo, hi = relayout["xaxis.range"][:2]
    if not isinstance(lo, int | float) or not isinstance(hi, int | float):
        return None
    return int(max(lo, 0)), int(hi) + 1


def clicked_rank(click: dict[str, Any] | None) -> int | None:
    """The rank of a clicked bar (customdata) or heatmap row (its label's first rank)."""
    points = (click or {}).get("points") or []
    if not points:
        return None
    point = points[0]
    if isinstance(point.get("customdata"), int):
        return int(point["customdata"])
    found = _RANK_LABEL.match(str(point.get("y", "")))
    return int(found.group(1)) if found else None
