"""Markdown tables of the check's figures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: ``-`` for None; floats with ``digits`` decimals, or significant digits when tiny or huge."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.{digits}f}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """The lines of a Markdown table, cells through ``fmt``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return lines
