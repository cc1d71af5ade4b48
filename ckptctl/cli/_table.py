"""A result table (a header row, then one row per item) as rich draws it, without importing rich
where that is not needed.

:func:`rich_table` is the reference: rich's ``Table`` with its default box (``HEAVY_HEAD``).
:func:`ruled` writes the same text off a terminal for cells of printable ASCII without outer
spaces (a character's width is one column and rich changes nothing), and None for anything
else, which then goes to rich. The fast path (``CKPTCTL_FAST_TABLE``, :mod:`ckptctl.fastpaths`)
spares a command's result under ``-q`` or in a pipe the ~20 ms of importing rich's table and
console; a test holds the two to the same text."""

from __future__ import annotations

from typing import Any, Sequence

Column = tuple[str, str]  # (header, "left" or "right")


def rich_table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> Any:
    """The rich ``Table`` of ``columns`` and ``rows``."""
    from rich.table import Table

    table = Table()
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*row)
    return table


def ruled(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> str | None:
    """The text rich prints for :func:`rich_table` off a terminal (no colour, unlimited width, each
    line without trailing spaces), or None where it cannot be sure to be the same."""
    if not rows or not columns or any(len(r) != len(columns) for r in rows):
        return None
    texts = [name for name, _ in columns] + [c for r in rows for c in r]
    if not all(t.isascii() and t.isprintable() and t == t.strip() for t in texts):
        return None  # (rich trims a justified cell's outer spaces)
    widths = [max(len(name), *(len(r[i]) for r in rows)) for i, (name, _) in enumerate(columns)]

    def line(cells: Sequence[str], edge: str) -> str:
        return edge + edge.join(" " + (c.ljust(w) if j == "left" else c.rjust(w)) + " "
                                for c, w, (_, j) in zip(cells, widths, columns)) + edge

    def rule(left: str, fill: str, cross: str, right: str) -> str:
        return left + cross.join(fill * (w + 2) for w in widths) + right

    lines = [rule("┏", "━", "┳", "┓"), line([name for name, _ in columns], "┃"), rule("┡", "━", "╇", "┩"),
             *(line(r, "│") for r in rows), rule("└", "─", "┴", "┘")]
    return "\n".join(x.rstrip() for x in lines) + "\n"
