"""The README's configuration table, generated from the settings dataclasses.

Every ``EngineArgs`` and ``ServerArgs`` field is a YAML key and a flag; its
metadata (help, unit, choices) and default are the single source of the
``--help`` text, this table and the checks on ``configs/*.yaml``.
``python -m pagedserve.server.config_table`` prints the table; paste it into README.md
between the ``<!-- config-table:start -->`` and ``<!-- config-table:end -->``
markers (a test fails when the two differ).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pagedserve.engine.config import EngineArgs
from pagedserve.server.app import ServerArgs

SETTINGS_CLASSES = (EngineArgs, ServerArgs)
TABLE_START = "<!-- config-table:start -->"
TABLE_END = "<!-- config-table:end -->"


def default_value(f: dataclasses.Field) -> Any:
    """The value a field takes when nobody sets it."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def shown_default(f: dataclasses.Field) -> str:
    """A field's default as the help, the table and the YAML comments show it: ``empty`` for
    None or [], ``true``/``false`` for booleans (as YAML writes them)."""
    default = default_value(f)
    if default is None or default == []:
        return "empty"
    if isinstance(default, bool):
        return str(default).lower()
    return str(default)


def _flag(f: dataclasses.Field, hint: Any) -> str:
    flag = f.name.replace("_", "-")
    return f"`--[no-]{flag}`" if hint is bool else f"`--{flag}`"


def _row(f: dataclasses.Field, hint: Any) -> str:
    description = f.metadata["help"]
    if f.metadata.get("choices"):
        # None is the unset value the description already calls "empty".
        description += "; one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"] if c is not None)
    cells = [f"`{f.name}`", _flag(f, hint), f"`{shown_default(f)}`", f.metadata.get("unit") or "", description]
    # Markdown would take "|" for a cell border and "<key>" for an HTML tag.
    escaped = (cell.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;") for cell in cells)
    return "| " + " | ".join(escaped) + " |"


def render_config_table() -> str:
    """The Markdown tables of every setting (engine, then server), without the markers."""
    parts = []
    for title, cls in zip(("Engine", "Server"), SETTINGS_CLASSES, strict=True):
        hints = typing.get_type_hints(cls)
        parts += [f"**{title} settings** (`{cls.__name__}`)", "",
                  "| YAML key | Flag | Default | Unit | Description |", "| --- | --- | --- | --- | --- |"]
        parts += [_row(f, hints[f.name]) for f in dataclasses.fields(cls)]
        parts.append("")
    return "\n".join(parts[:-1]) + "\n"


def readme_table(readme: str) -> str | None:
    """The text between the table markers of a README, or None when a marker is missing."""
    start, end = readme.find(TABLE_START), readme.find(TABLE_END)
    if start < 0 or end < start:
        return None
    return readme[start + len(TABLE_START):end].strip("\n") + "\n"


if __name__ == "__main__":
    print(render_config_table(), end="")
