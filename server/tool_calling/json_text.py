"""JSON text as tool-call formats stream it: where a value ends, and the pieces of a call's arguments."""

from __future__ import annotations

import json
from typing import Any

from pagedserve.engine.structured_output.compiler import JSON_FORMAT
from pagedserve.server.tool_calling.base import ParsedDelta, ToolCallDelta
from pagedserve.server.tool_calling.plan import ToolPlan


class ValueEnd:
    """Finds where one JSON value ends in text fed piece by piece (strings, escapes and nesting)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.done = False

    def feed(self, text: str) -> tuple[str, int]:
        """The part of ``text`` that belongs to the value (leading whitespace left out) and how many
        characters of ``text`` were read; fewer than all once the value has ended (``done``)."""
        start = 0 if self.started else None
        for i, char in enumerate(text):
            if not self.started:
                if char.isspace():
                    continue
                self.started, start = True, i
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return self._end(text, start, i + 1)
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif self.depth == 0 and (char in ",}]" or char.isspace()):  # after a number, true, false, null
                return self._end(text, start, i)
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self._end(text, start, i + 1)
        return ("" if start is None else text[start:]), len(text)

    def _end(self, text: str, start: int | None, end: int) -> tuple[str, int]:
        self.done = True
        return ("" if start is None else text[start:end]), end


def json_option(schema: dict[str, Any]) -> str:
    """``schema`` for ``%json``, with the engine's bounded JSON whitespace (``JSON_FORMAT``)."""
    own = schema.get("x-guidance")
    return json.dumps({**schema, "x-guidance": {**(own if isinstance(own, dict) else {}), **JSON_FORMAT}},
                      ensure_ascii=False)




def json_string(raw: str) -> str:
    """The text of a JSON string's inside (escapes decoded; kept as written when they are not valid)."""
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw




def add_arguments(delta: ParsedDelta, index: int, piece: str) -> None:
    """Add a piece of call ``index``'s arguments to ``delta``, in that call's piece if it has one."""
    if delta.calls and delta.calls[-1].index == index:
        delta.calls[-1].arguments += piece
    else:
        delta.calls.append(ToolCallDelta(index, None, piece))


def json_call_rules(plan: ToolPlan, arguments_key: str) -> list[str]:
    """Lark rules ``call_<i>`` for each callable tool: ``{"name": "<name>", "<arguments_key>": <its parameters>}``."""
    rules = []
    for i, tool in enumerate(plan.callable):
        head = json.dumps(f'{{"name": {json.dumps(tool.name)}, "{arguments_key}": ')
        rules += [f'call_{i}: {head} args_{i} "}}"', f"args_{i}: %json {json_option(tool.parameters)}"]
    return rules
