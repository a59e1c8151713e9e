"""Text that fits a terminal's width without a value split over two lines: a line cut at its
end, an id elided in its middle, items packed whole into lines, table columns dropped by
priority.

An id too long for its column keeps its start and its end, which tell ids apart (a name and
a timestamp: `demo-20261201-210247` in 14 columns is `demo-2…210247`); `…` marks the cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ELLIPSIS = "…"
MIN_ID_WIDTH = 12
"""An elided id keeps at least this many characters (its column is never narrower)."""


def clip(line: str, width: int) -> str:
    """The line, cut to `width` characters with `…` at the end when longer."""
    return line if len(line) <= width else line[: max(width - 1, 0)] + ELLIPSIS


def elide_middle(text: str, width: int) -> str:
    """The text in at most `width` characters: its start and its (longer) end kept, `…` in
    between (`demo-2…210247`); unchanged when it fits."""
    if len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    kept = width - 1
    head = kept // 2
    return text[:head] + ELLIPSIS + text[len(text) - (kept - head) :]


def pack(items: Iterable[str], width: int, *, sep: str = ", ", indent: str = "") -> list[str]:
    """The items joined into lines of at most `width` characters, none split over two lines
    (an item longer than a line is clipped); continuation lines start with `indent`."""
    lines: list[str] = []
    line = ""
    for item in items:
        candidate = f"{line}{sep}{item}" if line else item
        if not line or len(candidate) <= width:
            line = candidate
            continue
        lines.append(clip(line, width))
        line = indent + item
    if line:
        lines.append(clip(line, width))
    return lines


def first_fitting(items: Sequence[str], width: int, *, sep: str = ", ") -> str:
    """As many of the items, in order and whole, as fit in `width` characters joined by
    `sep` (the first one clipped when even it does not fit)."""
    line = ""
    for item in items:
        candidate = f"{line}{sep}{item}" if line else item
        if len(candidate) > width:
            break
        line = candidate
    if not line and items:
        return clip(items[0], width)
    return line


@dataclass(frozen=True, slots=True)
class Column:
    """A table column: its header, its cells, and how readily it is dropped."""

    header: str
    cells: list[str]
    drop_order: int | None = None
    """Columns are dropped lowest first when the table is too wide; None: never dropped."""
    elide: bool = False
    """An id column: elided in the middle (never wrapped) when dropping is not enough."""

    @property
    def width(self) -> int:
        return max(len(self.header), *(len(c) for c in self.cells))


def fit_columns(columns: Sequence[Column], width: int, *, gap: int = 2) -> list[Column]:
    """The columns that fit in `width` characters, `gap` apart: with an id column counted at
    a third of the width at most (a long id does not push the figures out), the droppable
    columns dropped in their order until the rest fits; then the id column takes what width
    is left (whole if it fits), or is elided in its middle to fit (to no fewer than
    MIN_ID_WIDTH characters)."""
    id_width = max(MIN_ID_WIDTH, width // 3)
    widths = [min(c.width, id_width) if c.elide else c.width for c in columns]

    def total(kept: Sequence[int]) -> int:
        return sum(widths[i] for i in kept) + gap * (len(kept) - 1)

    kept = list(range(len(columns)))
    droppable = sorted(
        (i for i, c in enumerate(columns) if c.drop_order is not None),
        key=lambda i: columns[i].drop_order or 0,
    )
    for i in droppable:
        if total(kept) <= width:
            break
        kept.remove(i)
    slack = width - total(kept)
    for i in kept:
        column = columns[i]
        if column.elide:
            least = min(column.width, max(MIN_ID_WIDTH, len(column.header)))
            target = max(min(widths[i] + slack, column.width), least)
            slack -= target - widths[i]
            widths[i] = target
    return [_elided(columns[i], widths[i]) if columns[i].elide else columns[i] for i in kept]


def _elided(column: Column, width: int) -> Column:
    cells = [elide_middle(c, width) for c in column.cells]
    return Column(column.header, cells, column.drop_order, column.elide)
