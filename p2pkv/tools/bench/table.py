"""Text tables of the ``p2pkv bench`` reports, and the values in their cells.

Every bench prints its results as right-aligned columns two spaces apart
under a header and a line of dashes (:func:`grid`). The cells are text the
caller formats; :func:`number` and :func:`yes_no` are the conversions the reports share. Units are the
caller's (a column's header names them). Pure functions, standard library
only.
"""

from __future__ import annotations

from collections.abc import Sequence


def grid_lines(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a text table: the header, a line of dashes, one line per row.

    Args:
        header: the column titles.
        rows: the cells, as text, each row as long as ``header``.

    Returns:
        Lines with every column right-aligned to its widest cell (title
        included) and columns two spaces apart; without rows, the header and
        its dashes.

    Raises:
        ValueError: a row of another length than ``header``.
    """
    if any(len(r) != len(header) for r in rows):
        raise ValueError(f"every row needs {len(header)} cells, one per column of {list(header)}")
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    return ["  ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)),
            "  ".join("-" * w for w in widths),
            *("  ".join(f"{c:>{w}}" for c, w in zip(r, widths, strict=True)) for r in rows)]


def grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """:func:`grid_lines` joined by newlines (no newline at the end)."""
    return "\n".join(grid_lines(header, rows))


def number(value: float | None, spec: str = ".1f") -> str:
    """``value`` formatted with the format spec ``spec`` (e.g. ``".2f"``), or ``n/a`` for None."""
    return "n/a" if value is None else format(value, spec)


def yes_no(ok: bool | None) -> str:
    """A check's outcome in a cell: ``yes``, ``NO`` (capitals, to stand out), or ``-`` when not checked."""
    return "-" if ok is None else "yes" if ok else "NO"
